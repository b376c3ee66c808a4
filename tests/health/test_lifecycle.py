"""The device lifecycle table: every allowed move passes, everything else is refused with a message
that names the move, the state and what is allowed."""
import itertools

import pytest

from hotspare.errors import HotspareError, InvalidTransition
from hotspare.health import lifecycle
from hotspare.health.lifecycle import State, transition

H, S, C, D, Q, R = State

# The table as the docs state it: (from, to) -> actor kinds allowed. Written out by hand on purpose,
# so a change to lifecycle.TABLE has to change this test too.
EXPECTED = {
    (H, S): {"rule", "operator"},
    (H, C): {"rule", "operator"},
    (S, H): {"rule", "operator"},
    (S, C): {"rule", "operator"},
    (C, H): {"operator"},
    (C, D): {"rule", "operator"},
    (D, C): {"operator"},
    (D, Q): {"rule", "operator"},
    (Q, H): {"diagnostics"},
    (Q, R): {"rule", "operator", "diagnostics"},
    (H, R): {"operator"},
    (S, R): {"operator"},
    (C, R): {"operator"},
    (D, R): {"operator"},
}
ACTOR = {"operator": "operator", "rule": "rule:thermal", "diagnostics": "diagnostics"}


def test_table_is_the_documented_one():
    assert {(m.src, m.dst): set(m.actors) for m in lifecycle.TABLE} == EXPECTED


@pytest.mark.parametrize("edge,kind", [(e, k) for e, kinds in EXPECTED.items() for k in sorted(kinds)],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else x)
def test_every_allowed_move_is_recorded(edge, kind):
    src, dst = edge
    t = transition(src, dst, actor=ACTOR[kind], reason="because", time=12.5, passes=2)
    assert (t.src, t.dst, t.time, t.reason, t.actor) == (src, dst, 12.5, "because", ACTOR[kind])
    assert lifecycle.Transition.from_json(t.to_json()) == t


@pytest.mark.parametrize("src,dst", [e for e in itertools.product(State, State) if e not in EXPECTED],
                         ids=lambda s: s.value)
def test_every_other_move_is_refused_and_says_what_is_allowed(src, dst):
    with pytest.raises(InvalidTransition) as e:
        transition(src, dst, actor="operator", reason="x", time=0, device="n1/gpu0", passes=9)
    msg = str(e.value)
    assert f"cannot move n1/gpu0 from {src.value} to {dst.value} (asked by operator)" in msg
    if src is R:
        assert "retired is terminal" in msg
    else:
        allowed = [d.value for (s, d) in EXPECTED if s is src]
        assert all(a in msg.split("allowed moves are:")[1] for a in allowed), msg


def test_wrong_actor_is_refused_with_who_may():
    with pytest.raises(InvalidTransition, match=r"only operator may make this move \(uncordon\)"):
        transition(C, H, actor="rule:thermal", reason="cooled down", time=0)
    with pytest.raises(InvalidTransition, match="only operator may"):
        transition(H, R, actor="diagnostics", reason="x", time=0)
    with pytest.raises(InvalidTransition, match="only diagnostics may"):
        transition(Q, H, actor="operator", reason="looks fine", time=0, passes=5)


def test_return_from_quarantine_needs_k_passes():
    with pytest.raises(InvalidTransition, match=r"passed diagnostics 1 time\(s\) in a row, 2 are required"):
        transition(Q, H, actor="diagnostics", reason="pass", time=0, passes=1)
    assert transition(Q, H, actor="diagnostics", reason="pass", time=0, passes=2).dst is H
    with pytest.raises(InvalidTransition, match="3 are required"):
        transition(Q, H, actor="diagnostics", reason="pass", time=0, passes=2, passes_required=3)


def test_bad_inputs_say_what_to_use():
    with pytest.raises(InvalidTransition, match="unknown state 'sick'; states are healthy, suspect"):
        transition("sick", "healthy", actor="operator", reason="x", time=0)
    with pytest.raises(InvalidTransition, match="unknown actor 'bob'"):
        transition(H, C, actor="bob", reason="x", time=0)
    with pytest.raises(InvalidTransition, match="unknown actor 'rule:'"):
        transition(H, C, actor="rule:", reason="x", time=0)
    with pytest.raises(InvalidTransition, match="a reason is required"):
        transition(H, C, actor="operator", reason="  ", time=0)
    with pytest.raises(InvalidTransition, match="already cordoned"):
        transition(C, C, actor="operator", reason="again", time=0)


def test_invalid_transition_is_in_the_error_tree():
    assert issubclass(InvalidTransition, HotspareError) and issubclass(InvalidTransition, ValueError)


def test_out_of_service_partition():
    assert lifecycle.IN_SERVICE | lifecycle.OUT_OF_SERVICE == set(State)
    assert not lifecycle.IN_SERVICE & lifecycle.OUT_OF_SERVICE


def test_lifecycle_is_pure():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(lifecycle))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "dataclasses", "enum", "typing", "hotspare"}, imported
