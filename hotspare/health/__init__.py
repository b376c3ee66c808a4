"""Health service: telemetry sources, multi-stage checks, rules, and the device lifecycle.

Layout:
  types.py       shared vocabulary (Reading, Verdict, actions, metric names); no torch, no I/O
  telemetry/     sources of readings: NVML (real GPUs) and the simulated source (CPU, tests)
  rules.py       rules as data -> verdicts; circuit breaker; repeat-offender rule
  lifecycle.py   device/node state machine (healthy -> suspect -> cordoned -> ...)
  registry.py    the persisted device registry shared by the coordinator and the CLI
  slurm.py       cordon/drain a node in Slurm itself
  checks/        admission burn-in, memory pattern, collective bandwidth, quarantine diagnostics
"""
