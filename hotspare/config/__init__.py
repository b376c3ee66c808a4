"""One typed configuration: kw-only dataclasses that validate themselves and generate the CLI.

  schema.py   option(), Section, and the generators: argparse arguments, from_namespace, to_argv
  run.py      RunConfig: every flag of ``hotspare run``, in sections (launch, capacity, hang,
              checkpoint, health, faults)
  doc.py      docs/CONFIG.md from these declarations and the worker contract
              (``python -m hotspare.config.doc > docs/CONFIG.md``)

What a worker is told lives beside it, in ``hotspare.protocol.workerenv`` (JobEnv, WorkerEnv).
Imports no torch and nothing of hotspare but errors and the worker contract.
"""
from hotspare.config.run import (CapacityConfig, CheckpointConfig, FaultConfig, HangConfig, HealthConfig,
                                 LaunchConfig, RunConfig)
from hotspare.config.schema import Option, Section, add_arguments, from_namespace, option, to_argv

__all__ = ["CapacityConfig", "CheckpointConfig", "FaultConfig", "HangConfig", "HealthConfig", "LaunchConfig",
           "Option", "RunConfig", "Section", "add_arguments", "from_namespace", "option", "to_argv"]
