import torch

from hotspare.runtime.data import batch_indices, seed_step, step_seed


def test_seed_is_a_pure_function_of_seed_rank_step():
    assert step_seed(1, 2, 3) == step_seed(1, 2, 3)
    assert len({step_seed(1, r, s) for r in range(4) for s in range(100)}) == 400
    a = torch.randn(5, generator=seed_step(7, 1, 10))
    torch.randn(100)                                 # unrelated draws in between
    b = torch.randn(5, generator=seed_step(7, 1, 10))
    assert torch.equal(a, b)


def test_batch_indices_cover_each_epoch_exactly_once_across_ranks():
    n, world, bs = 48, 4, 3
    steps_per_epoch = n // (world * bs)
    seen = torch.cat([batch_indices(s, r, world, bs, n, seed=5)
                      for s in range(steps_per_epoch) for r in range(world)])
    assert sorted(seen.tolist()) == list(range(n))
    # resumable: asking for step 2 directly equals what a run that got there would see
    assert torch.equal(batch_indices(2, 1, world, bs, n, seed=5), batch_indices(2, 1, world, bs, n, seed=5))
    assert not torch.equal(batch_indices(steps_per_epoch, 0, world, bs, n, 5), batch_indices(0, 0, world, bs, n, 5))
