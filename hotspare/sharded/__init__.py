"""Sharded jobs (FSDP2 / HSDP): the mesh over hotspare's generations, the local view of DTensor
state, and the pure decisions of where a lost rank's shard comes from.

Layering: ``plan`` imports nothing of torch (a pure function the simulator may share);
``localize`` and ``mesh`` import torch and ``hotspare.pg``; the worker runtime's seam is
``hotspare/runtime/sharded.py``; bytes between buddies move in ``hotspare/transfer/buddy.py``.
"""
