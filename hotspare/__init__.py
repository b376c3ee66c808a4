"""hotspare: keep PyTorch distributed training running through hardware failure.

    import hotspare
    job = hotspare.init()                       # instead of dist.init_process_group()
    model = job.ddp(model)                      # instead of DistributedDataParallel(model)
    job.track(model=model, optimizer=opt)       # the state a spare receives
    for step in job.steps(total):               # resumes at the committed step after a failover
        with step:
            ...

The runtime (and torch) is imported on first use, so ``hotspare plan`` stays instant.
"""
from hotspare.errors import ConfigError, HotspareError, JobFailed, PeerFailure

__version__ = "0.1.0"

_LAZY = {
    "init": "hotspare.runtime.job", "Job": "hotspare.runtime.job", "Step": "hotspare.runtime.job",
    "seed_step": "hotspare.runtime.data", "step_seed": "hotspare.runtime.data",
    "batch_indices": "hotspare.runtime.data",
}
__all__ = [*_LAZY, "HotspareError", "ConfigError", "JobFailed", "PeerFailure"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hotspare' has no attribute {name!r}")
