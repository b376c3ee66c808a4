"""Sharded jobs (FSDP / HSDP with buddy snapshots) on a fleet: which failures fall back to a checkpoint.

A sharded job recovers a lost rank from memory only if its shards survive somewhere: an HSDP
replica, its own memory while it drains, or its buddy snapshot on another host
(``hotspare.policy.recoverability``). Correlated failures break that: a whole host takes its
ranks *and* the snapshots it holds for its neighbours, a rack takes several hosts at once, and
failures that strike while the job is still recovering from another count as simultaneous.

``simulate_sharded`` draws failures as the fleet simulator does (Poisson, kinds by share,
rack-wide events), gives each kind a *scope* (one rank or the whole host), groups failures that
arrive before the previous recovery is done into one incident, and asks ``recover_shards`` about
each incident. The answer is a number: the share of failures that fall back to a checkpoint,
with its interval over seeds, which ``hotspare plan --fallback`` can then take.

``combinations`` lists the usual correlated cases for one placement (the table in
docs/ECONOMICS.md, "Sharded jobs").
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from hotspare.errors import ConfigError
from hotspare.policy.recoverability import Placement, Recoverability, recover_shards
from hotspare.sim import failure_math as fm
from hotspare.sim.fleet import FleetConfig
from hotspare.sim.presets import shares
from hotspare.sim.stats import mean_ci

# Which failure kinds of the default mix take one rank (its GPU or its process; the host, its RAM
# and its agent live on) and which take the whole host. Kinds not listed take the host: the
# conservative choice for a user-defined kind.
RANK_KINDS = frozenset({"gpu", "hbm_ecc", "software", "hang", "sdc"})


def scope(kind_name: str) -> str:
    return "rank" if kind_name in RANK_KINDS else "host"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedConfig(FleetConfig):
    """A sharded job on a fleet: one rank per GPU, mesh (replicate, world / replicate)."""
    replicate: int = 1             # HSDP replica groups; 1 is plain FSDP
    buddy_jump: int = 1            # hosts between a rank and its buddy; 0: no buddy snapshots
    snapshot_in: str = "agent"     # "agent" or "worker": the process that holds a snapshot
    drain_share: float = 0.0       # share of single-rank failures caught early and migrated

    def mesh(self) -> Placement:
        return Placement(world=self.gpus, ranks_per_host=self.gpus_per_node, replicate=self.replicate,
                         buddies=self.buddy_jump > 0, buddy_jump=max(self.buddy_jump, 1),
                         snapshot_in=self.snapshot_in)

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.drain_share <= 1:
            raise ConfigError(f"drain-share must be in [0, 100%] (got {self.drain_share:.1%})")
        if self.buddy_jump < 0:
            raise ConfigError("buddy-jump must be >= 0 (0 turns buddy snapshots off)")
        try:
            self.mesh()
        except ValueError as e:
            raise ConfigError(f"sharded placement: {e}") from None


@dataclasses.dataclass(frozen=True)
class ShardedRun:
    """One seed: failures counted by how their incident recovered."""
    failures: int
    destroyed: int             # fell back: the failure destroyed every copy (SDC, job-wide bug)
    no_copy: int               # fell back: some lost rank had no replica, no own memory, no buddy
    sources: dict[str, int]    # lost ranks by where their shards came from


def _draw_and_decide(cfg: ShardedConfig, placement: Placement, lam: float,
                     rng: np.random.Generator) -> ShardedRun:
    horizon = cfg.days * 24.0
    n = int(rng.poisson(lam * horizon))
    kinds = rng.choice(len(cfg.mix), size=n, p=shares(cfg.mix))
    times = np.sort(rng.uniform(0.0, horizon, n))
    hosts = rng.integers(0, cfg.nodes, size=n)
    local = rng.integers(0, cfg.gpus_per_node, size=n)
    u_rack, u_destroy, u_drain = rng.random(n), rng.random(n), rng.random(n)
    destroyed = no_copy = 0
    sources: Counter[str] = Counter()
    incident: list[int] = []
    end = -1.0

    def settle() -> None:
        nonlocal destroyed, no_copy
        if not incident:
            return
        if any(u_destroy[i] < cfg.mix[kinds[i]].destroys_state for i in incident):
            destroyed += len(incident)
            return
        dead_ranks, dead_hosts, draining = set(), set(), set()
        for i in incident:
            kind = cfg.mix[kinds[i]]
            host = int(hosts[i])
            if u_rack[i] < kind.correlated:
                start = host - host % cfg.rack_nodes
                dead_hosts.update(range(start, min(start + cfg.rack_nodes, cfg.nodes)))
            elif scope(kind.name) == "host":
                dead_hosts.add(host)
            else:
                rank = host * cfg.gpus_per_node + int(local[i])
                (draining if u_drain[i] < cfg.drain_share else dead_ranks).add(rank)
        decision: Recoverability = recover_shards(placement, dead_ranks=dead_ranks, dead_hosts=dead_hosts,
                                                  draining_ranks=draining)
        for s in decision.sources:
            sources[s.source] += 1
        if decision.path != "memory":
            no_copy += len(incident)

    for i in range(n):
        t = float(times[i])
        if t >= end:
            settle()
            incident = []
        incident.append(i)
        end = max(end, t + cfg.mix[kinds[i]].detect_h + cfg.downtime)
    settle()
    return ShardedRun(n, destroyed, no_copy, dict(sources))


@dataclasses.dataclass(frozen=True)
class ShardedResult:
    config: ShardedConfig
    runs: list[ShardedRun]

    def summary(self, level: float = 0.95) -> dict:
        def share(part) -> dict:
            values = [part(r) / r.failures if r.failures else 0.0 for r in self.runs]
            mean, half = mean_ci(values, level)
            return {"mean": mean, "ci": half}
        total = Counter()
        for r in self.runs:
            total.update(r.sources)
        return {
            "seeds": len(self.runs), "level": level,
            "failures": mean_ci([r.failures for r in self.runs], level)[0],
            "fallback_share": share(lambda r: r.destroyed + r.no_copy),
            "no_copy_share": share(lambda r: r.no_copy),
            "destroyed_share": share(lambda r: r.destroyed),
            "rank_sources": dict(total),
        }


def simulate_sharded(cfg: ShardedConfig, seeds: int = 20, seed: int = 0) -> ShardedResult:
    """Replay ``seeds`` failure traces of a sharded job and classify every failure's recovery."""
    cfg.validate()
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1 (got {seeds})")
    placement = cfg.mesh()
    lam = fm.failures_per_hour(cfg.afr, cfg.gpus)
    runs = [_draw_and_decide(cfg, placement, lam, np.random.default_rng(child))
            for child in np.random.SeedSequence(seed).spawn(seeds)]
    return ShardedResult(cfg, runs)


def combinations(p: Placement, rack_hosts: int) -> list[tuple[str, Recoverability]]:
    """The usual correlated losses for placement ``p``, each with ``recover_shards``' answer."""
    cases: list[tuple[str, dict]] = [
        ("one rank (GPU fault, worker crash)", {"dead_ranks": {0}}),
        ("one rank, still readable (thermal migration)", {"draining_ranks": {0}}),
    ]
    buddy = p.buddy(0)
    if buddy is not None:
        cases += [
            (f"a rank and its buddy's worker (ranks 0, {buddy})", {"dead_ranks": {0, buddy}}),
            (f"a rank and its buddy's host (rank 0, host {p.host(buddy)})",
             {"dead_ranks": {0}, "dead_hosts": {p.host(buddy)}}),
        ]
    cases.append(("a whole host (host 0)", {"dead_hosts": {0}}))
    if p.hosts >= 2:
        cases.append(("two adjacent hosts (0, 1)", {"dead_hosts": {0, 1}}))
    if p.hosts >= 4:
        cases.append((f"two hosts apart (0, {p.hosts // 2})", {"dead_hosts": {0, p.hosts // 2}}))
    if 1 < rack_hosts < p.hosts:
        cases.append((f"a rack ({rack_hosts} hosts)", {"dead_hosts": set(range(rack_hosts))}))
    if p.replicate >= 2:
        twin = p.replicas(0)[0]
        other = p.shard + 1 if p.shard > 1 else p.shard
        cases += [
            (f"a rank and its replica (ranks 0, {twin})", {"dead_ranks": {0, twin}}),
            (f"ranks of two groups, different shards (0, {other})", {"dead_ranks": {0, other}}),
            ("a whole replica group (group 0)", {"dead_ranks": set(range(p.shard))}),
        ]
    return [(name, recover_shards(p, **kwargs)) for name, kwargs in cases]
