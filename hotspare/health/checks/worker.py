"""One device's checks, in a process of its own: ``python -m hotspare.health.checks.worker CONFIG``.

Started by ``admission.run_admission`` / ``quarantine.run_quarantine``, one per device, with the
thread counts and device order set in its environment. It reports on stdout, one JSON object per
line after the marker ``@hotspare-check``, as each step finishes (so a crash loses only the step
in flight): ``progress``, ``facts``, ``result`` (a CheckResult), and ``done``. Other output
(library warnings) is ignored by the parent.

Admission order: facts -> join the device group -> burn-in (CPU devices take turns, so peers
sharing cores do not slow each other while timed) -> memory -> collective -> barrier -> exit.
Workers end with a barrier and ``os._exit(0)``: gloo's threads can abort a process that is
finishing normally.
"""
from __future__ import annotations

import datetime
import json
import os
import sys

from hotspare.health.checks.result import CheckResult, run_check

MARK = "@hotspare-check "


def emit(kind: str, **payload) -> None:
    sys.stdout.write(MARK + json.dumps({"type": kind, **payload}, default=str) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    cfg = json.loads(argv[1])
    name, kind, index = cfg["device"], cfg["kind"], cfg["index"]
    rank, world, stage = cfg["rank"], cfg["world"], cfg["stage"]
    sizes, inject = cfg["sizes"], set(cfg.get("inject", ()))

    import torch
    import torch.distributed as dist

    from hotspare.health.checks import inventory
    from hotspare.health.checks.burnin import burn_in
    from hotspare.health.checks.collective import bandwidth_test
    from hotspare.health.checks.memory import memory_test

    if kind == "cpu":
        torch.set_num_threads(1)
        tdev = "cpu"
    else:
        torch.cuda.set_device(index)
        tdev = f"cuda:{index}"

    def report(r: CheckResult) -> None:
        emit("result", result=r.to_dict())

    try:
        emit("facts", facts=inventory.collect(name, tdev))
    except Exception as e:  # noqa: BLE001
        report(CheckResult("inventory", name, False, f"could not collect facts: {type(e).__name__}: {e}"))

    group_error = None
    if world > 1:
        try:
            backend = "nccl" if kind == "gpu" and dist.is_nccl_available() else "gloo"
            store = dist.FileStore(cfg["store"], world)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
        except Exception as e:  # noqa: BLE001
            group_error = f"could not join the {world}-device group: {type(e).__name__}: {e}"
    grouped = world > 1 and group_error is None

    def burn():
        return burn_in(name, tdev, n=sizes["matmul_n"], reps=sizes["burn_reps"],
                       seconds=sizes["burn_seconds"], seed=cfg.get("seed", 0),
                       inject="bitflip" if "burnin" in inject else None)

    if grouped and kind == "cpu":
        for turn in range(world):
            if turn == rank:
                report(run_check("burn-in", name, burn))
            try:
                dist.barrier()
            except Exception as e:  # noqa: BLE001 - a peer died; carry on alone
                group_error = f"device group broke during burn-in: {type(e).__name__}: {e}"
                grouped = False
                if turn < rank:
                    report(run_check("burn-in", name, burn))
                break
    else:
        report(run_check("burn-in", name, burn))

    report(run_check("memory", name, lambda: memory_test(
        name, tdev, nbytes=sizes["mem_bytes"], inject="bitflip" if "memory" in inject else None)))

    if stage == "admission":
        if world == 1:
            report(CheckResult("collective", name, True, "only one device: no collective to test",
                               {"world": 1}, skipped=True))
        elif not grouped:
            report(CheckResult("collective", name, False, group_error or "no device group"))
        else:
            report(run_check("collective", name, lambda: bandwidth_test(
                name, tdev, nbytes=sizes["bw_bytes"], iters=sizes["bw_iters"])))
    emit("done")
    if grouped:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
