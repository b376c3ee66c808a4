"""The DeviceMesh of a sharded job, built once over proxies that follow hotspare's generations.

``ShardedMesh(shape, names, rank, current)``: the mesh is ``arange(world).view(shape)``, as
``init_device_mesh`` lays it out (HSDP's (replicate, shard): rank = r * shard + s). Each mesh
dimension gets one ``ProxyGroup`` (pg/proxy.py) for the group of ranks this rank shares that
dimension with. The real groups are made per generation, on first use, all at once and in one
order on every rank (``dist.new_group`` is collective): a 1-D mesh uses the generation's own
group; an n-D mesh one subgroup per row of each dimension; plus one group for buddy snapshots
(``buddy_group``), so their transfers never queue behind FSDP's collectives.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hotspare.errors import ConfigError, PeerFailure
from hotspare.pg.proxy import ProxyGroup

_count = 0


def dim_groups(shape: tuple[int, ...]) -> list[list[list[int]]]:
    """For each mesh dimension, every group of ranks along it (in a fixed order)."""
    mesh = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    out = []
    for d in range(len(shape)):
        moved = mesh.movedim(d, -1).reshape(-1, shape[d])
        out.append([row.tolist() for row in moved])
    return out


class ShardedMesh:
    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], rank: int,
                 current: Callable[[], Any], on_error: Callable[[BaseException], None] | None = None):
        """``current()``: the generation's ``GenerationGroup`` (or None between generations)."""
        global _count
        if len(shape) != len(names):
            raise ConfigError(f"mesh shape {shape} and mesh_dim_names {names} differ in length")
        world = int(torch.tensor(shape).prod())
        self.shape, self.names, self.rank, self.world = tuple(shape), tuple(names), rank, world
        self._current = current
        self._lock = threading.Lock()
        self._bound: tuple[Any, list[dist.ProcessGroup], dist.ProcessGroup] | None = None
        self.groups = dim_groups(self.shape)
        self.proxies: list[ProxyGroup] = []
        _count += 1
        for d, rows in enumerate(self.groups):
            mine = next(r for r in rows if rank in r)
            self.proxies.append(ProxyGroup(mine.index(rank), len(mine), f"hotspare_mesh{_count}_{names[d]}",
                                           lambda d=d: self.dim_group(d), on_error))
        self.device_mesh = DeviceMesh.from_group(self.proxies, "cpu", mesh=torch.arange(world).view(self.shape),
                                                 mesh_dim_names=self.names)

    def _bind(self) -> tuple[list[dist.ProcessGroup], dist.ProcessGroup]:
        gen = self._current()
        if gen is None or gen.aborted or gen.process_group is None:
            raise PeerFailure("the generation is not formed or was aborted")
        with self._lock:
            if self._bound is not None and self._bound[0] is gen:
                return self._bound[1], self._bound[2]
            if gen.world != self.world:
                raise AssertionError(f"mesh of {self.world} ranks in a generation of {gen.world}")
            dims = []
            for d, rows in enumerate(self.groups):
                if len(self.shape) == 1:
                    dims.append(gen.process_group)
                    continue
                mine = None
                for r in rows:             # every rank makes every group, in the same order
                    pg = gen.subgroup(r)
                    if self.rank in r:
                        mine = pg
                dims.append(mine)
            buddy = gen.subgroup(list(range(self.world)))
            for proxy in self.proxies:     # the last generation's teardown unregistered them
                proxy.register()
            self._bound = (gen, dims, buddy)
            return dims, buddy

    def dim_group(self, d: int) -> dist.ProcessGroup:
        return self._bind()[0][d]

    def buddy_group(self) -> dist.ProcessGroup:
        return self._bind()[1]

    def forget(self) -> None:
        """The generation is gone: drop its groups (the next use binds the next generation's)."""
        with self._lock:
            self._bound = None


__all__ = ["ShardedMesh", "dim_groups"]
