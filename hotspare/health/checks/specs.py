"""Peak dense tensor-core throughput of known GPUs, to judge a measured matmul against.

TFLOP/s, dense (NVIDIA's datasheets quote bf16/fp16 "with sparsity", twice these; we halve
them). A well-fed large bf16 GEMM typically reaches 60-80 % of the dense peak: boost clocks
are not sustained under full tensor-core load, and the datasheet peak assumes them.

Sources (NVIDIA datasheets):
  A100   "NVIDIA A100 Tensor Core GPU" datasheet: BF16 Tensor Core 312 TFLOPS (624 with
         sparsity), SXM4 and PCIe alike; TF32 156.
  H100   "NVIDIA H100 Tensor Core GPU" datasheet: BF16 Tensor Core 1,979 (SXM) / 1,513 (PCIe) /
         1,671 (NVL) TFLOPS with sparsity -> 989.5 / 756.5 / 835.5 dense.
  H200   "NVIDIA H200 Tensor Core GPU" datasheet: BF16 Tensor Core 1,979 (SXM) / 1,671 (NVL)
         TFLOPS with sparsity -> 989.5 / 835.5 dense.
"""
from __future__ import annotations

# (substring of torch.cuda.get_device_name / nvmlDeviceGetName, bf16 dense TFLOP/s); the first
# match wins, so the more specific names come first.
BF16_DENSE_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.5),
    ("H200", 989.5),             # "NVIDIA H200" (SXM)
    ("H100 NVL", 835.5),
    ("H100 PCIe", 756.5),
    ("H100", 989.5),             # "NVIDIA H100 80GB HBM3" (SXM5)
    ("A100", 312.0),             # "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", ...
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """The bf16 dense peak of the GPU called ``device_name``, or None if it is not in the table."""
    lowered = device_name.lower()
    for key, tflops in BF16_DENSE_TFLOPS:
        if key.lower() in lowered:
            return tflops
    return None
