"""``hotspare`` command: dispatches to one module per subcommand.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed args and returning an exit code. Modules are imported
only when listed, and heavy imports (torch) happen inside ``func``, so ``hotspare plan --help``
stays instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    ("run", "hotspare.cli.run"),
    ("agent", "hotspare.cli.agent"),     # a node agent on another host
    ("coordinator", "hotspare.cli.coordinator"),   # the service of many hosts and jobs
    ("submit", "hotspare.cli.jobs"),     # also registers status / cancel
    ("demo", "hotspare.cli.demo"),
    ("chaos", "hotspare.cli.chaos"),
    ("plan", "hotspare.cli.plan"),
    ("simulate", "hotspare.cli.simulate"),
    ("health", "hotspare.cli.health"),   # also registers cordon / drain / uncordon
    ("check", "hotspare.cli.check"),     # admission and quarantine diagnostics
    ("inject", "hotspare.cli.inject"),   # a fault for a running job
    ("events", "hotspare.cli.events"),   # a run's event stream (docs/OBSERVABILITY.md)
    ("report", "hotspare.cli.report"),   # a run's report: summary, --plot
    ("verify", "hotspare.cli.verify"),   # a script checked against the step contract
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotspare",
        description="Keep PyTorch distributed training running through hardware failure.",
        epilog="Run 'hotspare COMMAND --help' for the options of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:  # a subcommand still being built must not break the others
            if e.name != module:
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hotspare: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:          # `hotspare plan ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
