"""The bf16 burn-in and the datasheet table (health/checks/burnin.py, specs.py). On CPU the same
checks run small (bf16 on CPU accumulates in float32 too); the GPU run is bench/gpu_check.py."""
import pytest
import torch

from hotspare.errors import ConfigError
from hotspare.health.checks.burnin import burn_in
from hotspare.health.checks.specs import peak_bf16_tflops


@pytest.mark.parametrize("reference", ["host", "device"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_correct_device_passes_within_the_derived_tolerance(dtype, reference):
    r = burn_in("t/cpu0", "cpu", n=96, reps=2, dtype=dtype, reference=reference)
    m = r.measurements
    assert r.passed, r.detail
    assert m["dtype"] == dtype and m["bad_elements"] == 0 and 0 < m["max_err_over_tol"] <= 1
    assert m["tflops"] > 0 and m["peak_tflops"] is None and m["fraction_of_peak"] is None


def test_a_flipped_bit_in_a_bf16_result_fails_the_burn_in():
    r = burn_in("t/cpu0", "cpu", n=96, reps=2, dtype="bfloat16", inject="bitflip")
    assert not r.passed and r.measurements["bad_elements"] == 1
    assert "bfloat16" in r.detail and "beyond the float64 reference" in r.detail


def test_the_bf16_bound_holds_and_unknown_dtypes_or_references_are_refused():
    r = burn_in("t/cpu0", "cpu", n=64, reps=1, dtype="bfloat16")
    assert r.measurements["max_err_over_tol"] < 1.0
    with pytest.raises(ConfigError, match="dtype"):
        burn_in("t/cpu0", "cpu", n=64, reps=1, dtype="float16")
    with pytest.raises(ConfigError, match="reference"):
        burn_in("t/cpu0", "cpu", n=64, reps=1, reference="gpu")


def test_known_devices_have_their_datasheet_peak():
    assert peak_bf16_tflops("NVIDIA H200") == 989.5
    assert peak_bf16_tflops("NVIDIA H200 NVL") == 835.5
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.5
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.5
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == peak_bf16_tflops("NVIDIA A100 80GB PCIe") == 312.0
    assert peak_bf16_tflops("NVIDIA GeForce RTX 4090") is None and peak_bf16_tflops("cpu") is None


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: run bench/gpu_check.py on a GPU machine")
def test_on_a_gpu_the_bf16_burn_in_reports_its_fraction_of_the_peak():
    r = burn_in("gpu0", "cuda:0", n=4096, reps=5, dtype="bfloat16", reference="device")
    assert r.passed, r.detail
    if r.measurements["peak_tflops"]:
        assert 0.05 < r.measurements["fraction_of_peak"] < 1.2
