"""The rules and policy of a rule set as Markdown, so docs/HEALTH.md cannot drift from the data.

    python -m hotspare.health.rules_doc                                # print the default rules
    python -m hotspare.health.rules_doc my_rules.toml                  # check a user file, print the result
    python -m hotspare.health.rules_doc --update-doc docs/HEALTH.md    # rewrite the generated block
    python -m hotspare.health.rules_doc --check-doc docs/HEALTH.md     # exit 1 when that block is stale
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from hotspare.errors import ConfigError
from hotspare.health.rulefile import load_rules
from hotspare.health.rules import Policy, RuleSet

BEGIN = ("<!-- rules-table: generated from hotspare/health/default_rules.toml by "
         "`python -m hotspare.health.rules_doc --update-doc docs/HEALTH.md`; edit the TOML, not this block -->")
END = "<!-- /rules-table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rules_markdown(rules: RuleSet) -> str:
    lines = ["| Rule | Condition (`when`) | Held | Action | Trust memory | Implements |",
             "|---|---|---|---|---|---|"]
    for r in rules.rules:
        lines.append(f"| `{r.name}` | `{_cell(r.when)}` | {r.held} | {r.action} | "
                     f"{'yes' if r.trust_memory else '**no**'} | {_cell(r.ref)} |")
    return "\n".join(lines)


def policy_markdown(policy: Policy) -> str:
    lines = ["| `[policy]` setting | Value | Meaning |", "|---|---|---|"]
    for f in dataclasses.fields(policy):
        lines.append(f"| `{f.name}` | {getattr(policy, f.name):g} | {_cell(f.metadata.get('doc', ''))} |")
    return "\n".join(lines)


def generated_block(rules: RuleSet) -> str:
    return "\n".join([BEGIN, "", rules_markdown(rules), "", policy_markdown(rules.policy), "", END])


def update_doc(text: str, rules: RuleSet) -> str:
    """``text`` with the block between BEGIN and END replaced by the current tables."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ConfigError(f"the document has no generated rules block; add the two lines\n{BEGIN}\n{END}")
    return text[:start] + generated_block(rules) + text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotspare.health.rules_doc", description=__doc__.split("\n")[0])
    ap.add_argument("rules_file", nargs="?", help="a user rules file over the defaults (validated)")
    ap.add_argument("--update-doc", metavar="MD", help="rewrite the generated block of this Markdown file")
    ap.add_argument("--check-doc", metavar="MD", help="exit 1 when this file's generated block is stale")
    args = ap.parse_args(argv)
    try:
        rules = load_rules(args.rules_file)
        for path in filter(None, (args.update_doc, args.check_doc)):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            new = update_doc(text, rules)
            if args.check_doc:
                if new != text:
                    print(f"{path}: the rules block is stale; run "
                          f"python -m hotspare.health.rules_doc --update-doc {path}", file=sys.stderr)
                    return 1
            elif new != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
        if not (args.update_doc or args.check_doc):
            print(generated_block(rules))
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
