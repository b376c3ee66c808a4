"""Fleet economics: when live failover pays, in closed form and failure by failure.

- ``presets``: published failure rates (Llama 3, Meta RSC-1) and the default failure mix.
- ``failure_math``: Poisson failure odds, Young/Daly intervals, exact renewal goodput, Erlang-B spares.
- ``economics``: job inputs, goodput and dollars for every policy, break-even, sensitivity.
- ``pool``: where a replacement comes from (dedicated spares, borrowed from preemptible work, or
  none: shrink) and what one failure costs under each; ``clock``: a shrinking job's progress.
- ``fleet``: the discrete-event simulator, which replays ``hotspare.policy.recovery.plan_recovery``.
- ``sharded``: FSDP/HSDP jobs with buddy snapshots; replays ``hotspare.policy.recoverability``.
- ``validation``: the cases where the two must agree; ``plot``: the figure; ``stats``, ``units``.

Nothing here imports torch or sockets. numpy comes in with ``fleet`` (and so ``validation``,
``sharded`` and ``plot``),
matplotlib only inside ``plot``; ``hotspare plan`` needs neither.
"""
