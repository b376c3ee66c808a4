"""Fleet economics: when live failover pays, in closed form and failure by failure.

- ``presets``: published failure rates (Llama 3, Meta RSC-1) and the default failure mix.
- ``failure_math``: Poisson failure odds, Young/Daly intervals, exact renewal goodput, Erlang-B spares.
- ``economics``: job inputs, goodput and dollars for both policies, break-even, sensitivity.
- ``fleet``: the discrete-event simulator, which replays ``hotspare.policy.recovery.plan_recovery``.
- ``validation``: the cases where the two must agree; ``plot``: the figure; ``stats``, ``units``.

Nothing here imports torch. numpy comes in with ``fleet`` (and so ``validation`` and ``plot``),
matplotlib only inside ``plot``; ``hotspare plan`` needs neither.
"""
