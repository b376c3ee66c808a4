"""Ordinary DDP training scripts composed, seeded, from the features users combine.

The four example scripts and the ordinary-script tests hold; the next new shape of ordinary code
should be found by a test, not by a user. ``compose(seed)`` draws a ``Composition`` (a set of
features), ``render`` writes it as a small real script (seconds on 4 CPU ranks with gloo), and
``write`` puts it in a file. The features:

  batchnorm     a BatchNorm1d in the model (per-rank buffers, broadcast by DDP)
  dropout       dropout, with a per-rank torch seed
  accum         two micro-batches per step, the first under DDP's no_sync
  sched-inside  a tracked StepLR stepped inside the `with step:` block
  sched-after   ... stepped after the block (the common spot; issue #28 case 2)
  ema           an AveragedModel EMA of the model, tracked, updated in the step
  gan           a second model and optimizer (a generator/discriminator pair)
  unused        job.ddp(..., find_unused_parameters=True) and a branch some ranks take at some steps (case 5)
  eval-inside   rank 0 alone evaluates, iterating a shuffled DataLoader, inside a step (case 1)
  eval-between  ... between steps (case 3)
  loader        the data from job.loader(DataLoader(..., DistributedSampler, num_workers=2))
  epochs        with loader: `for epoch in job.epochs(E): for x, y in loader: with job.step():`
  early-stop    a `break` out of job.steps after the block, the same on every rank (case 6)
  scaler        a GradScaler (enabled=False on CPU), tracked, scaling the loss

Every script takes ``--steps N`` (or epochs' worth of them) and nothing else; the state it ends
with is read through ``HOTSPARE_VERIFY_OUT`` (hotspare/runtime/objdigest.py), as ``hotspare
verify`` does, so the same script runs under ``hotspare run`` and plain ``torchrun``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

FEATURES = ("batchnorm", "dropout", "accum", "sched-inside", "sched-after", "ema", "gan", "unused",
            "eval-inside", "eval-between", "loader", "epochs", "early-stop", "scaler")
_EXCLUSIVE = [("sched-inside", "sched-after"), ("gan", "unused"), ("epochs", "early-stop")]


@dataclass(frozen=True)
class Composition:
    seed: int
    features: frozenset[str]
    steps: int = 10           # steps the script runs (early-stop: it stops before)

    @property
    def name(self) -> str:
        return f"gen{self.seed}-" + "+".join(sorted(self.features)) if self.features else f"gen{self.seed}-plain"

    @property
    def args(self) -> list[str]:
        return ["--steps", str(self.steps)]

    def __post_init__(self) -> None:
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
        for a, b in _EXCLUSIVE:
            if a in self.features and b in self.features:
                raise ValueError(f"features {a} and {b} do not go together")
        if "epochs" in self.features and "loader" not in self.features:
            raise ValueError("the epochs feature needs the loader feature")


# Features whose composition issue #28 found wrong under hotspare (its case numbers); fixed in
# hotspare/runtime, not worked around here. A failing composition names those it has.
ISSUE_28_CASES = {"eval-inside": 1, "sched-after": 2, "eval-between": 3, "unused": 5, "early-stop": 6}


def open_cases(comp: Composition) -> str:
    """The issue-#28 cases a composition touches, for a failure's message."""
    cases = sorted((n, f) for f, n in ISSUE_28_CASES.items() if f in comp.features)
    return ", ".join(f"{f} (case {n})" for n, f in cases) or "none"


def kill_of(comp: Composition, world: int) -> Callable[[int], list[str]]:
    """One SIGKILL at a rank and step drawn from the composition's seed, given the steps it runs."""
    rng = random.Random(comp.seed * 7919 + 1)
    return lambda steps: [f"kill:rank={rng.randrange(world)}:step={rng.randrange(max(steps, 1))}"]


def compose(seed: int, p: float = 0.3) -> Composition:
    """A seeded composition: each feature with probability ``p``, exclusive pairs resolved."""
    rng = random.Random(seed)
    chosen = {f for f in FEATURES if rng.random() < p}
    for a, b in _EXCLUSIVE:
        if a in chosen and b in chosen:
            chosen.discard(rng.choice((a, b)))
    if "loader" not in chosen:
        chosen.discard("epochs")
    return Composition(seed, frozenset(chosen))


def write(comp: Composition, directory: str | Path) -> Path:
    path = Path(directory) / f"{comp.name.replace('+', '_').replace('-', '_')}.py"
    path.write_text(render(comp))
    return path


def _model(f: frozenset[str]) -> str:
    layers = ["nn.Linear(8, 32)"]
    if "batchnorm" in f:
        layers.append("nn.BatchNorm1d(32)")
    layers.append("nn.ReLU()")
    if "dropout" in f:
        layers.append("nn.Dropout(0.2)")
    return f'''class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential({", ".join(layers)})
        self.head = nn.Linear(32, 2)
        self.side = nn.Linear(32, 32) if {"unused" in f} else None   # only the steps that branch use it

    def forward(self, x, branch=False):
        h = self.body(x)
        if branch:
            h = h + torch.tanh(self.side(h))
        return self.head(h)
'''


def _step_body(f: frozenset[str], ind: str) -> str:
    """The body of one step: ``x, y`` are this step's batch; ``step`` its number."""
    lines = []
    branch = "bool(x[0, 0] > 0.3)" if "unused" in f else "False"      # data-dependent: differs between ranks
    back = "scaler.scale(loss).backward()" if "scaler" in f else "loss.backward()"
    opt_step = ["scaler.step(opt)", "scaler.update()"] if "scaler" in f else ["opt.step()"]
    if "gan" in f:
        lines += ["z = torch.randn(x.shape[0], 4, generator=noise)",
                  "fake = gen(z)",
                  "d_out = disc(torch.cat([x, fake.detach()]))       # one forward of each DDP model per backward",
                  "d_loss = (nn.functional.softplus(-d_out[:x.shape[0]]) + nn.functional.softplus(d_out[x.shape[0]:])).mean()",
                  "d_opt.zero_grad()", "d_loss.backward()", "d_opt.step()"]
    lines.append("opt.zero_grad()")
    if "accum" in f:
        lines += ["half = x.shape[0] // 2",
                  "with model.no_sync():",
                  f"    loss = nn.functional.cross_entropy(model(x[:half], {branch}), y[:half]) / 2",
                  f"    {back}",
                  f"loss = nn.functional.cross_entropy(model(x[half:], {branch}), y[half:]) / 2"]
    else:
        lines.append(f"loss = nn.functional.cross_entropy(model(x, {branch}), y)")
    if "gan" in f:
        lines[-1] += " - 0.01 * disc(fake).mean()"       # the generator's part, through the discriminator
    lines.append(back)
    lines += opt_step
    if "ema" in f:
        lines.append("ema.update_parameters(model.module)")
    if "sched-inside" in f:
        lines.append("sched.step()")
    if "eval-inside" in f:
        lines += ["if job.rank == 0 and step % 4 == 0:", "    evaluate(model.module, val)"]
    lines.append("job.log(loss=loss.item())")
    return "".join(f"{ind}{ln}\n" for ln in lines)


def _after_block(f: frozenset[str], ind: str) -> str:
    lines = []
    if "sched-after" in f:
        lines.append("sched.step()")
    if "eval-between" in f:
        lines += ["if job.rank == 0 and step % 4 == 2:", "    evaluate(model.module, val)"]
    if "early-stop" in f:
        lines += ["if step == args.steps - 4:      # e.g. a criterion on the replicated loss: the same on every rank",
                  "    break"]
    return "".join(f"{ind}{ln}\n" for ln in lines)


def render(comp: Composition) -> str:
    f = comp.features
    track = ["model=model", "optimizer=opt"]
    setup = []
    if "gan" in f:
        setup += ["gen = job.ddp(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8)))",
                  "disc = job.ddp(nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)))",
                  "d_opt = torch.optim.Adam(disc.parameters(), lr=1e-3)",
                  "opt = torch.optim.Adam(list(model.parameters()) + list(gen.parameters()), lr=1e-3)",
                  "noise = torch.Generator().manual_seed(500 + job.rank)"]
        track += ["gen=gen", "disc=disc", "d_optimizer=d_opt", "noise=noise"]
    else:
        setup.append("opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)")
    if "sched-inside" in f or "sched-after" in f:
        setup.append("sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)")
        track.append("scheduler=sched")
    if "ema" in f:
        setup.append("ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.9))")
        track.append("ema=ema")
    if "scaler" in f:
        setup.append('scaler = torch.amp.GradScaler("cpu", enabled=False)')
        track.append("scaler=scaler")
    loader = "loader" in f
    if loader:
        setup += ["train = TensorDataset(torch.randn(512, 8, generator=torch.Generator().manual_seed(3)),",
                  "                      torch.randint(0, 2, (512,), generator=torch.Generator().manual_seed(4)))",
                  "sampler = DistributedSampler(train, shuffle=True, seed=0)",
                  "loader = job.loader(DataLoader(train, batch_size=16, sampler=sampler, num_workers=2))"]
    else:
        setup.append("data = torch.Generator().manual_seed(100 + job.rank)")
        track.append("data=data")
    if "eval-inside" in f or "eval-between" in f:
        setup.append("val = DataLoader(TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(9))),"
                     " batch_size=16, shuffle=True)      # shuffling draws from torch's generator")
    batch = ("x, y = next(loader)" if loader else
             "x = torch.randn(16, 8, generator=data)\n{ind}y = (x[:, 0] + x[:, 1] > 0).long()")
    if "epochs" in f:
        epochs = max(1, comp.steps // 8)
        loop = (f"for epoch in job.epochs({epochs}):\n"
                "        sampler.set_epoch(epoch)\n"
                "        for x, y in loader:\n"
                "            with job.step() as step:\n"
                + _step_body(f, " " * 16) + _after_block(f, " " * 12))
    else:
        loop = ("for step in job.steps(args.steps):\n"
                "        with step:\n"
                "            " + batch.format(ind=" " * 12) + "\n"
                + _step_body(f, " " * 12) + _after_block(f, " " * 8))
    imports = ["import argparse", "", "import torch", "import torch.nn as nn"]
    if "ema" in f:
        imports.append("from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn")
    imports.append("from torch.utils.data import DataLoader, DistributedSampler, TensorDataset")
    evaluate = '''

def evaluate(model, val):
    model.eval()
    with torch.no_grad():
        total = sum(float(model(v).sum()) for (v,) in val)
    model.train()
    return total
''' if ("eval-inside" in f or "eval-between" in f) else ""
    body = "\n    ".join(setup)
    return f'''"""A generated ordinary DDP script (hotspare/testing/scriptgen.py), seed {comp.seed}:
features {", ".join(sorted(f)) or "none"}.

    hotspare verify -- THIS_FILE {" ".join(comp.args)}
"""
{chr(10).join(imports)}

import hotspare


{_model(f)}{evaluate}

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default={comp.steps})
    args = p.parse_args()
    torch.set_num_threads(1)
    job = hotspare.init()
    torch.manual_seed({comp.seed})
    model = job.ddp(Net(){", find_unused_parameters=True" if "unused" in f else ""})
    {body}
    torch.manual_seed({comp.seed} + 1 + job.rank)       # dropout masks differ per rank
    job.track({", ".join(track)})
    {loop}

if __name__ == "__main__":
    main()
'''
