"""Burn-in: float32 or bfloat16 matrix multiplies on the device, each checked against a float64
reference, and their throughput against the device's datasheet peak (``specs.py``).

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

bfloat16 (``dtype="bfloat16"``, what training runs on the tensor cores). A and B are drawn in
float32 and rounded to bfloat16 *before* the reference is computed, so the reference multiplies
exactly the inputs the device does. The products of two bfloat16 numbers are exact in float32,
and the sums are accumulated in float32 (reduced-precision reductions are switched off for the
run, ``allow_bf16_reduced_precision_reduction = False``), so the accumulation error obeys the same
bound with float32's u; the result is then rounded once to bfloat16, a relative error of at most
``2**-8`` (8 significand bits, round to nearest). Hence
``tol = gamma_n(2**-24) * (|A| @ |B|) * (1 + 2**-8) + 2**-8 * |A @ B|``. A flipped high bit of a
bfloat16 result changes it by 25-100 %, far beyond ``2**-8``.

The reference runs on the host (numpy, float64: independent of the device) or, for large n on a
GPU, on the device in float64 (``reference="device"``: the FP64 units, not the tensor cores that
compute the bf16 product; minutes of host time saved at n = 8192).

Throughput: after the checked repetitions, ``reps`` more run back to back (timed by CUDA events
on a GPU), giving sustained TFLOP/s; on a GPU of the spec table the result reports its fraction
of the dense peak, and ``min_peak_fraction`` makes a lower fraction a failure.

Fault injection (documented, for testing the check itself): ``inject="bitflip"`` flips the top
mantissa bit (float32: bit 22; bfloat16: bit 6) of one element of C in the last repetition, after
the multiply and before the comparison, as a silent data corruption in the GEMM path would.
"""
from __future__ import annotations

import statistics
import time

from hotspare.errors import ConfigError
from hotspare.health.checks.result import CheckResult, check_stop

FLIP_BIT = 22                 # float32's top mantissa bit
FLIP_BIT_BF16 = 6             # bfloat16's
INJECTIONS = ("bitflip",)
DTYPES = ("float32", "bfloat16")
REFERENCES = ("host", "device")


def flop_per_matmul(n: int) -> int:
    return 2 * n ** 3


def _reference(a, b, n: int, dtype_name: str, where, dev):
    """``(ref, tol)`` on ``dev``: the float64 product of the (already rounded) inputs and the
    per-element tolerance derived in the module docstring."""
    import numpy as np
    import torch

    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    if where == "host":
        a64, b64 = a.double().numpy(), b.double().numpy()
        ref64 = a64 @ b64
        bound = gamma * (np.abs(a64) @ np.abs(b64))
        ref, tol = torch.from_numpy(ref64).to(dev), torch.from_numpy(bound).to(dev)
    else:
        a64, b64 = a.to(dev, torch.float64), b.to(dev, torch.float64)
        ref = a64 @ b64
        tol = gamma * (a64.abs() @ b64.abs())
        del a64, b64
    if dtype_name == "bfloat16":
        tol = tol * (1 + 2.0 ** -8) + 2.0 ** -8 * ref.abs()
    return ref, tol


def burn_in(device: str, torch_device: str = "cpu", *, n: int, reps: int, seconds: float = 0.0,
            seed: int = 0, inject: str | None = None, stop=None, dtype: str = "float32",
            reference: str = "host", min_peak_fraction: float | None = None) -> CheckResult:
    """Run ``reps`` checked multiplies (and keep going until ``seconds`` have passed), then
    ``reps`` back to back for the sustained throughput. Setting ``stop`` (a ``threading.Event``)
    ends it after the current multiply with ``CheckCancelled``."""
    import torch

    from hotspare.health.checks.specs import peak_bf16_tflops

    if n < 2 or reps < 1:
        raise ConfigError(f"burn-in needs n >= 2 and reps >= 1, got n={n}, reps={reps}")
    if inject not in (None, *INJECTIONS):
        raise ConfigError(f"burn-in injection {inject!r} unknown; use one of {', '.join(INJECTIONS)}")
    if dtype not in DTYPES or reference not in REFERENCES:
        raise ConfigError(f"burn-in dtype must be one of {DTYPES} and reference one of {REFERENCES}, "
                          f"got {dtype!r}, {reference!r}")
    t_begin = time.perf_counter()
    dev = torch.device(torch_device)
    tdtype = getattr(torch, dtype)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float32).to(tdtype)   # rounded before the reference
    b = torch.randn(n, n, generator=g, dtype=torch.float32).to(tdtype)
    ref, tol = _reference(a, b, n, dtype, reference, dev)
    A, B = a.to(dev), b.to(dev)
    C = torch.empty(n, n, dtype=tdtype, device=dev)
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
        if inject == "bitflip" and done and dtype == "float32":
            bits = C.view(torch.int32)
            i, j = n // 3, n // 5
            bits[i, j] = bits[i, j] ^ (1 << FLIP_BIT)
        elif inject == "bitflip" and done:           # bfloat16: the largest result, so that
            i, j = divmod(int(torch.argmax(ref.abs())), n)     # the flip is far beyond 2**-8
            bits = C.view(torch.int16)
            bits[i, j] = bits[i, j] ^ (1 << FLIP_BIT_BF16)
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
    sustained = flop * reps / sustained_seconds(torch, A, B, C, reps, dev) / 1e12
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = peak_bf16_tflops(name) if dev.type == "cuda" and dtype == "bfloat16" else None
    fraction = sustained / peak if peak else None
    m = {"n": n, "reps": len(times), "gflops": round(best, 3), "gflops_median": round(median, 3),
         "max_err_over_tol": worst, "bad_elements": bad_total, "dtype": dtype,
         "device": str(dev), "device_name": name, "reference": reference,
         "tflops": sustained, "peak_tflops": peak,
         "fraction_of_peak": None if fraction is None else round(fraction, 4)}
    if bad_total:
        rep, i, j, got, want, e, t = first_bad
        detail = (f"{bad_total} element(s) of C = A @ B (n={n}, {dtype}) beyond the float64 reference's "
                  f"tolerance; first in rep {rep} at [{i}, {j}]: got {got!r}, expected {want!r} "
                  f"(error {e:.3g} > tolerance {t:.3g})")
        return CheckResult("burn-in", device, False, detail, m, time.perf_counter() - t_begin)
    speed = (f"{sustained:.1f} TFLOP/s sustained = {fraction:.0%} of the {name}'s {peak:g} bf16 dense peak"
             if fraction is not None else f"{best:.1f} GFLOP/s best, {median:.1f} median")
    detail = (f"{len(times)} x C = A @ B (n={n}, {dtype}) all within the float64 reference's "
              f"tolerance (worst {worst:.1%} of it); {speed}")
    if min_peak_fraction is not None and fraction is not None and fraction < min_peak_fraction:
        return CheckResult("burn-in", device, False, f"too slow: {speed}, below the required "
                           f"{min_peak_fraction:.0%}", m, time.perf_counter() - t_begin)
    return CheckResult("burn-in", device, True, detail, m, time.perf_counter() - t_begin)


def sustained_seconds(torch, A, B, C, reps: int, dev) -> float:
    """Seconds for ``reps`` multiplies back to back: CUDA events on a GPU (no host gaps between
    launches), the wall clock on CPU."""
    if dev.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            torch.mm(A, B, out=C)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(A, B, out=C)
    return time.perf_counter() - t0
