"""Process groups per generation: build, abort, rebuild."""
from hotspare.pg.generation import GenerationGroup, local_process_group

__all__ = ["GenerationGroup", "local_process_group"]
