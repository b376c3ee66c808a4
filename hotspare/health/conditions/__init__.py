"""The condition language of health rules: parsed here, never ``eval``-ed; pure.

A condition reads one device's readings (oldest first) at one of them, the *current* one::

    temp_c >= 90                       a metric of the current reading against a threshold
    pcie_width < pcie_width_max        two metrics of the same reading
    delta(ecc_dbe_volatile) > 0        a counter's increase since the previous reading that reports it
    rate(pcie_replay, 60) > 16         a counter's increase over the last 60 s before `now`, per minute
    clock_event_reasons & 0xC8         bits of a bitmask (true when any of them is set)
    xids in {48, 95}                   membership; for the list-valued `xids`: any code in the set
    xids not in {13, 31}               ... any code outside the set
    recovery_action in {'gpu_reset'}   a string metric against its documented values
    remap_pending                      a flag on its own
    straggler_score < policy.straggler_score_min      a named constant (the rules file's [policy] table)
    a and b · a or b · not a · ( ... )

A metric the reading leaves out (or reports with the wrong type) is *unknown*: comparisons with it are
unknown, ``and``/``or``/``not`` follow three-valued (Kleene) logic, and a rule fires only on true, so a
missing value never fires a rule, nor its negation. A counter below its previous value was reset (GPU
reset, driver reload); the increase across the reset is the new value, as Prometheus counts it.

Parsing checks names and types, so a rules file with ``temp >= 90``, ``delta(temp_c)``,
``xids == 79`` or ``recovery_action in {'gpu_rest'}`` fails on load with a message that says what to write.
Reason templates use the same terms: ``"{temp_c} C"``, ``"{rate(pcie_replay, 60)}/min"``, ``"{x & 0xC8:#x}"``.

The package: ``tree`` (the metric vocabulary and the syntax tree), ``parse`` (text -> tree, checked),
``evaluate`` (a tree over readings, reasons rendered). Its public names are re-exported here.
"""
from __future__ import annotations

from hotspare.health.conditions.evaluate import fmt, render, term_value, truth
from hotspare.health.conditions.parse import SPECIAL, ConditionError, parse_condition, parse_template
from hotspare.health.conditions.tree import (BITMASK, CHOICE, CHOICES, CODES, COUNTER, FLAG, METRIC_KINDS, NOTE,
                                             NUMBER, metrics_of, rate_window_s, uses_delta)

__all__ = ["BITMASK", "CHOICE", "CHOICES", "CODES", "COUNTER", "FLAG", "METRIC_KINDS", "NOTE", "NUMBER", "SPECIAL",
           "ConditionError", "fmt", "metrics_of", "parse_condition", "parse_template", "rate_window_s", "render",
           "term_value", "truth", "uses_delta"]
