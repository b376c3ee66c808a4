"""Process groups per generation: build, abort, rebuild; and DDP's own group of one."""
from hotspare.pg.generation import GenerationGroup
from hotspare.pg.solo import SoloGroup

__all__ = ["GenerationGroup", "SoloGroup"]
