"""The shape of the code base: imports go one way, modules stay small (../STYLE notes)."""
from hotspare.testing.imports import ROOT, cycles, graph

MAX_LINES = 500


def test_no_import_circle_among_hotspare_modules():
    # every import counts, lazy or under TYPE_CHECKING: a hidden circle is still a circle
    assert cycles(graph()) == []


def test_the_checker_sees_a_circle(tmp_path):
    pkg = tmp_path / "hotspare"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from hotspare.sub import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from hotspare.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    assert cycles(graph(pkg)) == [["hotspare.sub.a", "hotspare.sub.b"]]


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (over {MAX_LINES} lines): {long}"


def test_nothing_below_the_command_line_imports_it():
    # cli/ is an edge: the service, the coordinator and the runtime never reach up into it
    # (the test harness in testing/ runs `hotspare run` in-process, so it may)
    up = {(m, t) for m, ts in graph().items() for t in ts
          if t.startswith("hotspare.cli") and not m.startswith(("hotspare.cli", "hotspare.testing"))
          and m != "hotspare.__main__"}
    assert up == set()
