"""A warm spare's CUDA context (runtime/cudawarm.py): a no-op that says why without CUDA; on a GPU
it creates the context, loads cuBLAS and reserves the pool (also timed by bench/gpu_check.py)."""
import pytest
import torch

from hotspare.runtime.cudawarm import warm_cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU test below runs instead")
def test_without_cuda_nothing_is_warmed_and_it_says_why():
    w = warm_cuda("cuda:0", pool_bytes=1 << 20)
    assert "CUDA is not available" in w.skipped and w.device is None and w.total_s == 0.0
    assert not torch.cuda.is_initialized()
    with pytest.raises(ValueError):
        warm_cuda(pool_bytes=-1)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: run bench/gpu_check.py on a GPU machine")
def test_on_a_gpu_the_context_is_live_and_the_pool_reserved():
    w = warm_cuda("cuda:0", pool_bytes=256 << 20)
    assert not w.skipped and w.device == "cuda:0" and torch.cuda.is_initialized()
    assert w.pool_bytes >= 256 << 20 and w.total_s >= w.init_s
    before = torch.cuda.memory_reserved(0)
    x = torch.empty(128 << 20, dtype=torch.uint8, device="cuda:0")     # served from the pool
    assert torch.cuda.memory_reserved(0) == before
    del x
