"""Fault injection, a testing plug-in: real signals on real processes, and health faults.

Nothing in the production path imports this package. ``hotspare run`` loads it when the job is
started with ``--inject`` or ``--allow-inject`` (``hotspare inject`` then arms faults in the
running job), and the worker side is told by ``HOTSPARE_FAULTS=1`` in its environment
(``hotspare.protocol.workerenv.WorkerEnv.faults``). Four parts:

- ``grammar``: the fault specs (``KIND:key=value...``), parsed into ``Fault``;
- ``agent``: ``AgentFaults``, the node agent's side: it matches the workers' triggers (``step``,
  ``joining``, ``transfer``, sent with ``wait`` while faults are armed) to armed faults, carries
  them out (a signal, ``exit_now``, ``fault`` to the worker, the simulated telemetry of its
  device) and answers ``go``;
- ``coordinator``: ``CoordinatorFaults``, the coordinator's side: arms faults on every node agent,
  records when each fired (``FAULT injected`` in the log, the failure's ``fault_at``) and answers
  the operator's ``inject`` command;
- ``worker``: ``FaultHooks``, the worker's side, behind the runtime's one seam
  (``hotspare.runtime.hooks``): it sends the triggers, waits for ``go`` while watched, and does
  to itself the faults a worker does (``slow``, ``nan``, ``corrupt``, ``exit_now``).
"""
import importlib

# Imported on first use: a worker that loads its side (``worker``) pulls in neither the agent's
# nor the coordinator's.
_WHERE = {"AgentFaults": "agent", "Injector": "agent", "Arming": "coordinator", "CoordinatorFaults": "coordinator",
          "GRAMMAR": "grammar", "Fault": "grammar", "parse": "grammar"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"hotspare.testing.faults.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'hotspare.testing.faults' has no attribute {name!r}")
