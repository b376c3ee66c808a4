"""The progress line of long commands (hotspare/cli/progress.py), driven by a fake clock: on a
terminal one line redrawn in place with the bar, elapsed time and time left, lines printed
meanwhile landing above it; elsewhere a plain line at most every period, none for a quick
command. `hotspare simulate --plot` counts the plot's simulations in its total."""
import io

import pytest

from hotspare.cli import progress
from hotspare.cli.progress import Progress, duration


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def bar(tty: bool, total: int = 3, **kw):
    clock, out = Clock(), io.StringIO()
    kw.setdefault("delay_s", 0.0)
    return Progress("chaos", total, stream=out, tty=tty, clock=clock, redraw=False, **kw), clock, out


def test_on_a_terminal_one_line_is_redrawn_with_the_bar_elapsed_and_time_left():
    p, clock, out = bar(tty=True)
    clock.t += 10
    p.advance()
    assert out.getvalue() == "\r\x1b[Kchaos  1/3 runs  [########................]   33%  elapsed 10s  left ~20s"
    clock.t += 50
    p.advance()
    assert out.getvalue().rsplit("\r\x1b[K", 1)[1] == ("chaos  2/3 runs  [################........]   67%  "
                                                       "elapsed 1m00s  left ~30s")
    above = io.StringIO()
    p.print("[chaos] faulted run: exit 0", file=above)
    assert above.getvalue() == "[chaos] faulted run: exit 0\n"
    assert out.getvalue().endswith("\r\x1b[K\r\x1b[Kchaos  2/3 runs  [################........]   67%  "
                                   "elapsed 1m00s  left ~30s")       # cleared, printed above, redrawn
    clock.t += 30
    p.advance()
    p.close()
    assert out.getvalue().endswith("chaos  3/3 runs  [########################]  100%  elapsed 1m30s  left ~0s\n")
    assert "\n" not in out.getvalue()[:-1]                # one line, redrawn in place


def test_the_time_left_counts_down_from_the_mean_run_then_says_it_is_over():
    p, clock, out = bar(tty=False, total=3)
    clock.t += 10
    p.advance()
    clock.t += 5
    assert p.text() == "chaos  1/3 runs   33%  elapsed 15s  left ~15s"
    clock.t += 20
    assert p.text() == "chaos  1/3 runs   33%  elapsed 35s  left: over the mean run"


def test_on_a_terminal_a_quick_command_leaves_no_bar():
    p, clock, out = bar(tty=True, delay_s=1.0)
    for _ in range(3):
        clock.t += 0.2
        p.advance()
    p.close()
    assert out.getvalue() == ""


def test_elsewhere_a_plain_line_at_most_every_period():
    p, clock, out = bar(tty=False, total=4, period_s=30.0)
    clock.t += 5
    p.advance()
    assert out.getvalue() == ""
    clock.t += 26
    p.advance()
    assert out.getvalue() == "chaos  2/4 runs   50%  elapsed 31s  left ~31s\n"
    clock.t += 10
    p.advance()                                           # 10 s after the last line: none
    assert out.getvalue().count("\n") == 1
    clock.t += 9
    p.advance()
    p.close()                                             # the trail ends at the end
    assert out.getvalue().splitlines() == ["chaos  2/4 runs   50%  elapsed 31s  left ~31s",
                                           "chaos  4/4 runs  100%  elapsed 50s  left ~0s"]
    assert "\r" not in out.getvalue() and "[" not in out.getvalue()


def test_elsewhere_a_quick_command_writes_nothing():
    p, clock, out = bar(tty=False)
    for _ in range(3):
        clock.t += 1
        p.advance()
    p.close()
    assert out.getvalue() == ""


def test_a_run_beyond_the_plan_grows_the_total():
    p, clock, out = bar(tty=True, total=1)
    p.advance()
    p.grow()
    clock.t += 4
    p.advance()
    p.advance()
    assert "3/3 runs" in out.getvalue().rsplit("\r\x1b[K", 1)[1]


def test_not_a_terminal_by_default_for_a_pipe_or_file():
    with Progress("x", 2, stream=io.StringIO()) as p:
        assert p.tty is False


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (0, 42.4, 185, 3599, 7620)] == ["0s", "42s", "3m05s", "59m59s", "2h07m"]


def test_simulate_plot_counts_the_plots_simulations_in_the_total(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from hotspare.cli.main import build_parser
    bars = []

    class Seen(Progress):
        def __init__(self, what, total, **kw):
            super().__init__(what, total, stream=io.StringIO(), tty=False, redraw=False)
            self.planned = total
            bars.append(self)
    monkeypatch.setattr(progress, "Progress", Seen)
    args = build_parser().parse_args(["simulate", "--gpus", "1024", "--days", "30", "--seeds", "3",
                                      "--plot", str(tmp_path / "econ.png"), "--plot-sizes", "512,1024"])
    assert args.func(args) == 0
    (bar,) = bars
    assert bar.planned == bar.done == bar.total == 3 * (1 + 2)       # the run's seeds, then each size's
