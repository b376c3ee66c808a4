"""``hotspare plan`` and ``hotspare simulate`` as a user runs them: output, JSON, exit codes."""
import json
import subprocess
import sys

import pytest


def hotspare(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotspare", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.mark.parametrize("gpus,expected", [("256", "19.0%"), ("1024", "56.9%")])
def test_plan_prints_the_seed_probabilities(gpus, expected):
    out = hotspare("plan", "--gpus", gpus, "--days", "30", "--preset", "afr-1pct")
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if "P(at least one failure" in l)
    assert line.split()[-1] == expected


def test_plan_json_has_the_numbers():
    out = hotspare("plan", "--gpus", "2048", "--preset", "meta-rsc1", "--interval", "2h",
                   "--restart", "45m", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["inputs"]["interval"] == 2.0 and plan["inputs"]["restart"] == 0.75
    assert 0 < plan["checkpoint"]["goodput"] < plan["hotspare"]["goodput"] < 1
    assert plan["net_saving_usd_year"] > 0
    assert plan["drivers"][0]["name"] in {"afr", "interval", "restart"}


def test_plan_compares_sizes_and_presets_in_one_table():
    out = hotspare("plan", "--gpus", "1024,2048,16384", "--preset", "afr-1pct,llama3-405b,meta-rsc1")
    assert out.returncode == 0, out.stderr
    rows = [l for l in out.stdout.splitlines() if l.startswith(("afr-1pct", "llama3", "meta-rsc1"))]
    assert len(rows) == 9


def test_plan_reads_a_config_file_and_flags_win(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('gpus = 4096\npreset = "llama3-405b"\nrestart = "45m"\nprice = 2.5\n')
    out = hotspare("plan", "--config", str(cfg), "--price", "4", "--json")
    assert out.returncode == 0, out.stderr
    inputs = json.loads(out.stdout)["inputs"]
    assert (inputs["gpus"], inputs["restart"], inputs["price"]) == (4096, 0.75, 4.0)


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "0"], "gpus"),
    (["--gpus", "1024", "--afr=-1%"], "afr must be > 0"),
    (["--gpus", "1024", "--stall", "5m", "--interval", "2m"], "longer than the checkpoint stall"),
    (["--gpus", "1024", "--restart", "30"], "unit"),
    (["--gpus", "1024", "--preset", "nope"], "unknown preset"),
    (["--gpus", "1024", "--preset", "afr-1pct", "--afr", "1%"], "either --preset or --afr"),
    (["--days", "30"], "--gpus"),
    (["--gpus", "many"], "whole number"),
])
def test_plan_rejects_impossible_inputs(args, needle):
    out = hotspare("plan", *args)
    assert out.returncode == 2
    assert out.stderr.startswith("hotspare plan: error:") and needle in out.stderr, out.stderr
    assert out.stdout == ""


def test_plan_reads_yaml_too(tmp_path):
    pytest.importorskip("yaml")
    cfg = tmp_path / "job.yaml"
    cfg.write_text("gpus: 4096\npreset: meta-rsc1\nstall: 30s\n")
    out = hotspare("plan", "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["inputs"]["stall"] == pytest.approx(30 / 3600)


def test_simulate_config_can_redefine_the_mix(tmp_path):
    cfg = tmp_path / "fleet.toml"
    cfg.write_text('gpus = 1024\ndays = 30\nseeds = 3\n[mix.gpu]\nweight = 3\nrepair = "3d"\n'
                   '[mix.psu]\nweight = 1\ndetect = "10s"\nrepair = "7d"\ncorrelated = 1.0\n')
    out = hotspare("simulate", "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    mix = {k["name"]: k for k in json.loads(out.stdout)["config"]["mix"]}
    assert set(mix) == {"gpu", "psu"} and mix["gpu"]["repair_h"] == 72 and mix["psu"]["correlated"] == 1


def test_plan_rejects_unknown_config_keys(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("gpus = 64\nrestart_time = \"1h\"\n")
    out = hotspare("plan", "--config", str(cfg))
    assert out.returncode == 2 and "restart_time" in out.stderr


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_help_teaches(command):
    out = hotspare(command, "--help")
    assert out.returncode == 0
    assert "examples:" in out.stdout and "docs/ECONOMICS.md" in out.stdout
    assert "(default" in out.stdout


def test_simulate_reports_both_policies():
    out = hotspare("simulate", "--gpus", "2048", "--days", "30", "--seeds", "5")
    assert out.returncode == 0, out.stderr
    for needle in ("checkpoint-restart", "live failover", "goodput", "closed form",
                   "recovered, no step lost", "spare pool short", "plan_recovery"):
        assert needle in out.stdout


def test_simulate_json_and_mix_override():
    out = hotspare("simulate", "--gpus", "1024", "--days", "30", "--seeds", "3", "--mix", "gpu=1",
                   "--fallback", "0", "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert [k["name"] for k in body["config"]["mix"]] == ["gpu"]
    assert body["summary"]["hotspare"]["paths"].get("checkpoint", 0) == 0
    assert body["plan"]["inputs"]["fallback"] == 0


def test_simulate_plots(tmp_path):
    png = tmp_path / "econ.png"
    out = hotspare("simulate", "--gpus", "1024", "--days", "30", "--seeds", "3",
                   "--plot", str(png), "--plot-sizes", "512,1024")
    assert out.returncode == 0, out.stderr
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "1001"], "multiple of gpus-per-node"),
    (["--gpus", "1024", "--seeds", "1"], "at least 2"),
    (["--gpus", "1024", "--mix", "meteor=1"], "unknown kind"),
    (["--gpus", "1024,2048"], "one value"),
    (["--gpus", "1024", "--placement", "diagonal"], "placement"),
])
def test_simulate_rejects_impossible_inputs(args, needle):
    out = hotspare("simulate", *args)
    assert out.returncode == 2
    assert out.stderr.startswith("hotspare simulate: error:") and needle in out.stderr, out.stderr


# --- borrowed spares and shrinking ------------------------------------------------------------

def test_plan_compares_every_way_to_survive_failures():
    out = hotspare("plan", "--gpus", "2048", "--lendable", "5%", "--lend-pause", "1m",
                   "--lender-nodes", "2", "--replica-nodes", "1")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for needle in ("dedicated spares", "borrowed", "shrink", "spares or lenders / year",
                   "12 node(s) of preemptible work", "60 s lender pause", "256 copies of the state",
                   "2-node lenders", "Cheapest way to survive failures here:"):
        assert needle in text, needle


def test_plan_json_carries_borrowed_and_shrunk():
    out = hotspare("plan", "--gpus", "2048", "--lendable", "0%", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["inputs"]["lendable_share"] == 0 and plan["borrowed"]["no_lender"] == 1.0
    assert plan["shrunk"]["copies"] == 16


def test_plan_table_names_the_cheapest_policy():
    out = hotspare("plan", "--gpus", "1024,16384", "--preset", "afr-1pct,llama3-405b")
    assert out.returncode == 0, out.stderr
    rows = [l for l in out.stdout.splitlines() if l.startswith(("afr-1pct", "llama3"))]
    assert len(rows) == 4
    assert all(l.rstrip().endswith(("checkpoint-restart", "dedicated spares", "borrowed", "shrink"))
               for l in rows)


def test_simulate_replays_borrowing_and_shrinking():
    out = hotspare("simulate", "--gpus", "2048", "--days", "30", "--seeds", "3", "--lender", "shrink",
                   "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["config"]["lender"] == "shrink"
    for policy in ("hotspare", "borrow", "shrink"):
        assert "net_saving_usd_year" in body["summary"][policy]
    text = hotspare("simulate", "--gpus", "2048", "--days", "30", "--seeds", "3")
    assert "borrowed" in text.stdout and "of the copies down for repair" in text.stdout


@pytest.mark.parametrize("command,args,needle", [
    ("plan", ["--gpus", "1024", "--lender", "evict"], "lender must be one of"),
    ("plan", ["--gpus", "1024", "--lend-pause", "30"], "unit"),
    ("simulate", ["--gpus", "1024", "--lender-nodes", "0"], "lender-nodes"),
])
def test_pool_options_reject_impossible_inputs(command, args, needle):
    out = hotspare(command, *args)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_help_explains_the_pool_options(command):
    out = hotspare(command, "--help").stdout
    for flag in ("--lendable", "--lend-pause", "--lend-resume", "--lender-nodes", "--lender ",
                 "--lender-value", "--replica-nodes"):
        assert flag in out, flag
    assert "Kubernetes' default termination" in " ".join(out.split())


def test_simulate_sharded_reports_the_fallback_share_and_the_table():
    out = hotspare("simulate", "--gpus", "256", "--days", "365", "--seeds", "3", "--sharded", "fsdp",
                   "--buddy-jump", "4", "--replica-nodes", "1")
    assert out.returncode == 0, out.stderr
    for needle in ("fall back to a checkpoint", "two adjacent hosts", "buddy snapshots 4 host(s) on",
                   "recover_shards"):
        assert needle in out.stdout, needle
    body = json.loads(hotspare("simulate", "--gpus", "64", "--days", "30", "--seeds", "2", "--sharded",
                               "hsdp:2", "--json").stdout)
    assert body["config"]["replicate"] == 2
    assert {c["path"] for c in body["combinations"]} <= {"memory", "checkpoint"}


@pytest.mark.parametrize("args,needle", [
    (["--sharded", "zero3"], "'fsdp' or 'hsdp:R'"),
    (["--buddy-jump", "2"], "only apply with --sharded"),
    (["--sharded", "fsdp", "--snapshot-in", "disk"], "snapshot_in"),
    (["--sharded", "fsdp", "--plot", "x.png"], "leave it out with --sharded"),
])
def test_simulate_sharded_rejects_impossible_inputs(args, needle):
    out = hotspare("simulate", "--gpus", "64", *args)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_simulate_sharded_from_a_config_file(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('gpus = 64\ndays = 30\nseeds = 2\nsharded = "hsdp:2"\nbuddy_jump = 0\n')
    out = hotspare("simulate", "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)["config"]
    assert (config["replicate"], config["buddy_jump"]) == (2, 0)


def test_plan_does_not_recommend_checkpoints_when_borrowing_pays():
    text = " ".join(hotspare("plan", "--gpus", "1024").stdout.split())
    assert "dedicated spares does not pay" in text
    assert "cheaper answer" not in text and "Cheapest way to survive failures here: borrowed" in text
