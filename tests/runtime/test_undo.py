"""What a failed attempt's loop iteration does after its step block is undone (runtime/undo.py),
and the per-rank rows' end-of-step check (runtime/rankstate.py): in-process, in milliseconds."""
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from hotspare.errors import StateTrackingError
from hotspare.pg import SoloGroup
from hotspare.runtime.rankstate import RankState, RowTable
from hotspare.runtime.undo import Undo


def objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    return dict(model=model, optimizer=opt, scheduler=sched, ema=ema)


def test_a_scheduler_stepped_after_the_failed_block_is_put_back_with_the_learning_rate():
    o = objects()
    undo = Undo(o)
    o["scheduler"].step()                      # code after the block, for the failed attempt
    assert o["optimizer"].param_groups[0]["lr"] == 0.05
    assert sorted(undo.restore()) == ["optimizer.param_groups", "scheduler"]
    assert o["optimizer"].param_groups[0]["lr"] == 0.1 and o["scheduler"].last_epoch == 0
    o["scheduler"].step()                      # the re-run's own step: once, as without the failure
    assert o["optimizer"].param_groups[0]["lr"] == 0.05


def test_an_ema_updated_after_the_failed_block_is_put_back_exactly():
    o = objects()
    o["ema"].update_parameters(o["model"])
    before = {k: v.clone() for k, v in o["ema"].state_dict().items()}
    undo = Undo(o)
    o["ema"].update_parameters(o["model"])    # after the block: counts the update, moves the average
    assert undo.restore() == ["ema"]
    after = o["ema"].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nothing_changed_after_the_block_restores_nothing():
    o = objects()
    assert Undo(o).restore() == []


def test_trained_parameters_changed_after_the_failed_block_are_a_clear_error():
    o = objects()
    undo = Undo(o)
    with torch.no_grad():
        o["model"][0].weight.clamp_(-0.01, 0.01)   # weight clipping after the block
    with pytest.raises(StateTrackingError, match="Move that code into the step block"):
        undo.restore()


def test_rows_note_what_a_rank_changed_after_its_exchange_without_a_collective_of_its_own():
    state = RankState()
    rows = RowTable(state)
    group = _Group()
    rows.begin(group, 1, 5)
    rows.finish()
    assert group.gathers == 1
    torch.rand(3)                             # rank-0 work after the backward: draws
    assert rows.close(group, 1, 5) == ["rng/torch"]
    assert group.gathers == 1, "the end of a step with an exchange gathers nothing more"
    assert rows.close(group, 1, 6) == [] and group.gathers == 2, "a step without one gathers once"


class _Group:
    """A world of one with the generation group's all_gather."""

    def __init__(self):
        self.gathers = 0
        self.solo = SoloGroup()

    def all_gather(self, out, tensor):
        self.gathers += 1
        return self.solo._allgather_base(out, tensor)
