"""The in-process runtime: init, the step/commit protocol, the state registry, data and RNG."""
