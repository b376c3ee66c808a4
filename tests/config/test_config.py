"""The one typed configuration of `hotspare run` (hotspare/config): every knob declared once,
checked by itself with a message naming the flag, and the parser, --help and docs/CONFIG.md
generated from the declarations."""
import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hotspare.config import preflight
from hotspare.config import (CapacityConfig, CheckpointConfig, FaultConfig, HangConfig, HealthConfig, LaunchConfig,
                             RunConfig, add_arguments, from_namespace, to_argv)
from hotspare.config.doc import render
from hotspare.config.schema import default_of, options
from hotspare.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
ALL = list(options(RunConfig))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotspare run")
    add_arguments(p, RunConfig)
    return p


def parse(argv: list[str]) -> RunConfig:
    return from_namespace(RunConfig, parser().parse_args(argv))


def test_every_field_is_an_option_with_help_and_its_own_flags():
    seen = set()
    for path, _cls, f, opt in ALL:
        assert len(opt.help) > 15, path
        for name in opt.names(f.name):
            assert name not in seen, f"{name} is declared twice"
            seen.add(name)
    # The flags users and docs name stay (these existed before the config was typed).
    assert {"--nproc", "--nproc-per-node", "--spares", "--inject", "--report", "--log-every", "--hang-floor",
            "--hang-factor", "--join-timeout", "--checkpoint-dir", "--checkpoint-every", "--checkpoint-seconds",
            "--resume", "--checkpoint-key", "--max-replacements", "--capacity-wait", "--telemetry",
            "--telemetry-period", "--devices", "--health-rules", "--health-db", "--admission",
            "--fingerprint-every", "--local-nodes", "--spawn", "--master-addr", "--master-port", "--secret-file",
            "--oversubscribe", "--backend"} <= seen


def test_the_parser_s_defaults_are_the_dataclasses_defaults():
    assert parse(["train.py"]) == RunConfig(script="train.py")
    cfg = RunConfig(script="train.py")
    assert (cfg.launch.nproc, cfg.capacity.spares, cfg.hang.hang_floor, cfg.hang.join_timeout,
            cfg.launch.backend, cfg.health.fingerprint_every, cfg.launch.spawn) == (1, 1, 2.0, 5.0, "gloo", 10, "fork")


def test_a_config_round_trips_through_its_flags():
    cfg = RunConfig(launch=LaunchConfig(nproc=3, oversubscribe=True, backend="gloo", local_nodes=2, spawn="exec",
                                        master_port=29500, report="r.json", log_every=5),
                    capacity=CapacityConfig(spares=2, max_replacements=0, capacity_wait=1.5),
                    hang=HangConfig(hang_floor=0.25, hang_factor=3.0, join_timeout=7.0),
                    checkpoint=CheckpointConfig(checkpoint_dir="ck", checkpoint_every=4, checkpoint_seconds=0.5,
                                                resume="old", checkpoint_key="k.key"),
                    health=HealthConfig(telemetry="simulated", devices=6, admission="small", fingerprint_every=1),
                    faults=FaultConfig(inject=("kill:rank=0:step=3", "hang:rank=1:step=5")),
                    script="train.py", script_args=("--steps", "4", "--", "x"))
    argv = to_argv(cfg)
    assert parse(argv) == cfg, argv
    # Each non-default value is said once, by its flag.
    assert argv.count("--inject") == 2 and "--backend" not in argv and "--hang-floor" in argv


def test_the_separator_before_the_script_s_arguments_is_not_passed_to_it():
    assert parse(["train.py", "--", "--steps", "3"]).script_args == ("--steps", "3")
    assert parse(["--nproc", "2", "--", "train.py", "--steps", "3"]).script_args == ("--steps", "3")


def _outside(opt):
    """A value just outside each declared bound."""
    if opt.at_least is not None:
        yield opt.at_least - 1
    if opt.above is not None:
        yield opt.above
    if opt.at_most is not None:
        yield opt.at_most + 1
    if opt.choices is not None:
        yield "no-such-choice"
    if opt.parse is not None and opt.kind == "value":
        yield float("nan")


@pytest.mark.parametrize("path, cls, field, opt, bad",
                         [(p, c, f, o, b) for p, c, f, o in ALL for b in _outside(o)],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_every_declared_bound_is_enforced_with_a_message_naming_the_flag(path, cls, field, opt, bad):
    if opt.parse is int and isinstance(bad, float) and bad == bad:
        bad = int(bad)
    with pytest.raises(ConfigError, match=re.escape(opt.name(field.name))):
        cls(**{field.name: bad})


@pytest.mark.parametrize("build, says", [
    (lambda: LaunchConfig(nproc=0), "--nproc must be at least 1 (got 0): it is the number of training ranks"),
    (lambda: LaunchConfig(nproc="2"), "--nproc must be an integer"),
    (lambda: LaunchConfig(master_port=70000), "--master-port must be 0 (any free port) or a port 1-65535"),
    (lambda: LaunchConfig(backend="mpi"), "--backend must be one of gloo, nccl"),
    (lambda: CapacityConfig(spares=-1), "--spares must be 0 or more (got -1)"),
    (lambda: HangConfig(hang_factor=0.5), "--hang-factor must be at least 1"),
    (lambda: HangConfig(join_timeout=float("inf")), "--join-timeout must be a finite number"),
    (lambda: CheckpointConfig(checkpoint_every=3), "--checkpoint-every/--checkpoint-seconds need --checkpoint-dir"),
    (lambda: HealthConfig(devices=5000), "--devices 5000: at most 4096"),
    (lambda: RunConfig(script="t.py", health=HealthConfig(devices=1)), "--devices 1 is fewer than --nproc + --spares"),
    (lambda: RunConfig(script="t.py", launch=LaunchConfig(nproc=2, local_nodes=4)),
     "--local-nodes 4 is more than the 3 device slots"),
    (lambda: FaultConfig(inject=["kill:rank=0:step=1"]), "--inject must be a tuple of strings"),
])
def test_a_bad_config_built_in_code_is_refused_naming_the_flag(build, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        build()


def test_rules_that_tie_sections_together_hold_only_where_they_apply():
    off = RunConfig(script="t.py", launch=LaunchConfig(nproc=2, local_nodes=4), health=HealthConfig(telemetry="off"))
    assert off.slots == 3              # without telemetry a node agent needs no device slot of its own
    assert RunConfig(script="t.py", health=HealthConfig(devices=8)).slots == 8


def test_nccl_is_refused_where_cuda_is_not_available(monkeypatch, tmp_path):
    import torch
    script = tmp_path / "t.py"
    script.write_text("")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--backend nccl needs CUDA"):
        preflight.preflight(RunConfig(script=str(script), launch=LaunchConfig(backend="nccl")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    preflight.check_nccl()             # with CUDA it is accepted
    assert preflight.preflight(RunConfig(script=str(script))).faults == []


def test_run_help_lists_every_flag_its_sections_the_fault_grammar_and_the_defaults():
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for path, cls, f, opt in ALL:
        for name in opt.names(f.name):
            assert name in text, name
        if cls.TITLE:
            assert cls.TITLE in text
        default = default_of(f)
        if opt.kind == "value" and default is not None:
            shown = opt.default_text or (f"{default:g}" if isinstance(default, float) else str(default))
            assert f"(default: {shown})" in " ".join(text.split()), path
    assert "kill:rank=R:step=S" in text and "examples:" in text and "exit status:" in text


def test_the_config_imports_no_torch_so_help_stays_instant():
    code = "import sys, hotspare.cli.run, hotspare.config.doc; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_docs_config_md_is_what_the_declarations_render():
    assert (REPO / "docs" / "CONFIG.md").read_text() == render(), \
        "docs/CONFIG.md is stale: python -m hotspare.config.doc > docs/CONFIG.md"


def test_docs_config_md_names_every_flag_and_every_hotspare_variable_the_package_uses():
    doc = (REPO / "docs" / "CONFIG.md").read_text()
    for path, _cls, f, opt in ALL:
        assert f"`{path}`" in doc and all(f"`{n}`" in doc for n in opt.names(f.name))
    names = set()
    for source in (REPO / "hotspare").rglob("*.py"):
        names |= set(re.findall(r"\bHOTSPARE_[A-Z0-9_]*[A-Z0-9]\b", source.read_text()))
    assert names, "the scan found nothing: it is broken"
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"document these in hotspare/config/doc.py (OTHER_VARIABLES) or the contract: {missing}"
