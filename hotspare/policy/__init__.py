"""Pure decisions: no torch, no sockets, no clocks. Fast to test; the simulator replays them."""
