"""Burn-in: float32 matrix multiplies on the device, each checked against a float64 reference.

The reference is computed once, on the host, by numpy in float64 — a different library (numpy's
BLAS, not torch's kernels), a different precision, and for GPUs a different chip than the one
under test — so a fault in the device's GEMM cannot also corrupt the answer it is checked against.

Tolerance. For a dot product of length n computed in floating point with unit roundoff u, in any
summation order, with or without FMA, ``|fl(a.b) - a.b| <= gamma_n * (|a|.|b|)`` with
``gamma_n = n*u / (1 - n*u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, Thm 3.5).
With float32 (u = 2**-24) the per-element tolerance is therefore ``gamma_n * (|A| @ |B|)[i, j]``,
computed in float64. It is a worst-case bound: correct IEEE hardware can never exceed it (no false
alarms on any BLAS), while the faults that matter — a flipped exponent or high mantissa bit —
overshoot it by orders of magnitude. Typical results use a few percent of it; ``max_err_over_tol``
reports how much. TF32 is switched off for the run: its 10-bit mantissa is not float32 arithmetic.

Fault injection (documented, for testing the check itself): ``inject="bitflip"`` flips bit 22 —
the top mantissa bit — of one element of C in the last repetition, after the multiply and before
the comparison, as a silent data corruption in the GEMM path would.
"""
from __future__ import annotations

import statistics
import time

from hotspare.errors import ConfigError
from hotspare.health.checks.result import CheckResult, check_stop

FLIP_BIT = 22
INJECTIONS = ("bitflip",)


def flop_per_matmul(n: int) -> int:
    return 2 * n ** 3


def burn_in(device: str, torch_device: str = "cpu", *, n: int, reps: int, seconds: float = 0.0,
            seed: int = 0, inject: str | None = None, stop=None) -> CheckResult:
    """Run ``reps`` checked multiplies (and keep going until ``seconds`` have passed). Setting
    ``stop`` (a ``threading.Event``) ends it after the current multiply with ``CheckCancelled``."""
    import numpy as np
    import torch

    if n < 2 or reps < 1:
        raise ConfigError(f"burn-in needs n >= 2 and reps >= 1, got n={n}, reps={reps}")
    if inject not in (None, *INJECTIONS):
        raise ConfigError(f"burn-in injection {inject!r} unknown; use one of {', '.join(INJECTIONS)}")
    t_begin = time.perf_counter()
    dev = torch.device(torch_device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float32)
    b = torch.randn(n, n, generator=g, dtype=torch.float32)
    a64, b64 = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
    u = 2.0 ** -24
    gamma = n * u / (1 - n * u)
    ref = torch.from_numpy(a64 @ b64).to(dev)
    tol = torch.from_numpy(gamma * (np.abs(a64) @ np.abs(b64))).to(dev)
    A, B = a.to(dev), b.to(dev)
    C = torch.empty(n, n, dtype=torch.float32, device=dev)
    torch.mm(A, B, out=C)          # warm-up: kernel choice, first-touch page faults
    sync()

    times: list[float] = []
    bad_total, worst, first_bad = 0, 0.0, None
    t_loop = time.perf_counter()
    while True:
        check_stop(stop, "burn-in")
        sync()
        t0 = time.perf_counter()
        torch.mm(A, B, out=C)
        sync()
        times.append(time.perf_counter() - t0)
        done = len(times) >= reps and time.perf_counter() - t_loop >= seconds
        if inject == "bitflip" and done:
            bits = C.view(torch.int32)
            i, j = n // 3, n // 5
            bits[i, j] = bits[i, j] ^ (1 << FLIP_BIT)
        err = (C.double() - ref).abs()
        ratio = torch.nan_to_num(err / tol, nan=float("inf"))      # NaN never passes
        bad = ~(err <= tol)
        nbad = int(bad.sum())
        worst = max(worst, float(ratio.max()))
        if nbad and first_bad is None:
            flat = int(torch.argmax(ratio))
            i, j = divmod(flat, n)
            first_bad = (len(times), i, j, float(C[i, j]), float(ref[i, j]), float(err[i, j]), float(tol[i, j]))
        bad_total += nbad
        if done:
            break

    flop = flop_per_matmul(n)
    best = flop / min(times) / 1e9
    median = flop / statistics.median(times) / 1e9
    m = {"n": n, "reps": len(times), "gflops": round(best, 3), "gflops_median": round(median, 3),
         "max_err_over_tol": worst, "bad_elements": bad_total, "dtype": "float32",
         "device": str(dev)}
    if bad_total:
        rep, i, j, got, want, e, t = first_bad
        detail = (f"{bad_total} element(s) of C = A @ B (n={n}) beyond the float64 reference's "
                  f"tolerance; first in rep {rep} at [{i}, {j}]: got {got!r}, expected {want!r} "
                  f"(error {e:.3g} > tolerance {t:.3g})")
        return CheckResult("burn-in", device, False, detail, m, time.perf_counter() - t_begin)
    detail = (f"{len(times)} x C = A @ B (n={n}, float32) all within the float64 reference's "
              f"tolerance (worst {worst:.1%} of it); {best:.1f} GFLOP/s best, {median:.1f} median")
    return CheckResult("burn-in", device, True, detail, m, time.perf_counter() - t_begin)
