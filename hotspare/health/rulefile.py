"""Reading health rules files: the packaged defaults (``default_rules.toml``) and a user's file,
parsed by the pure ``hotspare.health.rules.parse_rules``. The I/O of the rules lives here only."""
from __future__ import annotations

import os
from importlib import resources

from hotspare.errors import ConfigError
from hotspare.health.rules import RuleSet, parse_rules

DEFAULT_RULES = "default_rules.toml"
DEFAULT_SOURCE = "hotspare/health/default_rules.toml"


def default_rules_text() -> str:
    """The text of the packaged default rules file."""
    return resources.files("hotspare.health").joinpath(DEFAULT_RULES).read_text(encoding="utf-8")


def load_rules(path: str | os.PathLike | None = None) -> RuleSet:
    """The default rules, overridden by the rules file at ``path`` when given.

    A user file overrides by rule name: a ``[[rule]]`` with a default rule's name changes only the keys it
    gives (``enabled = false`` disables it); a new name adds a rule; ``replace_defaults = true`` drops every
    default rule first. ``[policy]`` keys override one by one. Any mistake raises ``ConfigError``.
    """
    texts = [(default_rules_text(), DEFAULT_SOURCE)]
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append((f.read(), os.fspath(path)))
        except OSError as e:
            raise ConfigError(f"cannot read rules file {os.fspath(path)!r}: {e.strerror}") from None
    return parse_rules(texts)


def loads_rules(text: str, *, source: str = "<string>", defaults: bool = True) -> RuleSet:
    """Like ``load_rules`` for a file's text; ``defaults=False`` reads ``text`` alone."""
    return parse_rules(([(default_rules_text(), DEFAULT_SOURCE)] if defaults else []) + [(text, source)])
