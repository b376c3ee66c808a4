"""Declare a knob once: a dataclass field whose metadata holds its flag, help, choices and bounds.

* ``option(default, help=..., ...)`` makes such a field.
* A ``Section`` is a frozen kw-only dataclass of options; a field whose ``default_factory`` is
  a section nests it (its ``TITLE`` becomes an argument group of ``--help``).
* ``add_arguments(parser, cls)`` generates the argparse arguments, ``from_namespace(cls, ns)``
  builds the config back from what argparse parsed, ``to_argv(config)`` says it as flags.
* Every section's ``__post_init__`` checks the declared bounds and choices (``check``), then its
  own ``validate()``: a config built in code is refused exactly as one parsed from flags, with
  a ``ConfigError`` that names the flag.

Only the standard library and ``hotspare.errors``: ``hotspare run --help`` stays instant.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable, ClassVar, Iterator

from hotspare.errors import ConfigError

KINDS = ("value", "switch", "append", "positional", "remainder")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """What the command line knows of one field."""
    help: str
    flags: tuple[str, ...] = ()          # the first names it in messages; (): --the-field-name
    kind: str = "value"                  # one of KINDS
    parse: Callable[[str], Any] | None = None   # argparse's type: str -> value
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    default_text: str | None = None      # how --help states the default, when not its value
    why: str = ""                        # added to a bound's error message

    def names(self, field: str) -> tuple[str, ...]:
        """Its flags: those declared, else ``--field-name``; a positional's is its field name."""
        if self.kind in ("positional", "remainder"):
            return (field,)
        return self.flags or ("--" + field.replace("_", "-"),)

    def name(self, field: str) -> str:
        return self.names(field)[0]


def option(default: Any = dataclasses.MISSING, *, help: str, flags: tuple[str, ...] | None = None,
           kind: str = "value", parse: Callable[[str], Any] | None = None, metavar: str | None = None,
           choices: tuple[Any, ...] | None = None, at_least: float | None = None, above: float | None = None,
           at_most: float | None = None, default_text: str | None = None, why: str = "") -> Any:
    """A config field and its command-line option (``--field-name`` unless ``flags`` says)."""
    if kind not in KINDS:
        raise ValueError(f"option kind {kind!r} is not one of {KINDS}")
    meta = Option(help=help, flags=tuple(flags or ()), kind=kind, parse=parse, metavar=metavar, choices=choices,
                  at_least=at_least, above=above, at_most=at_most, default_text=default_text, why=why)
    if kind in ("append", "remainder"):
        return dataclasses.field(default=() if default is dataclasses.MISSING else tuple(default),
                                 metadata={"option": meta})
    if kind == "switch" and default is dataclasses.MISSING:
        default = False
    return dataclasses.field(default=default, metadata={"option": meta})


def section(cls: type) -> Any:
    """A field that nests the section ``cls`` (all its fields take their defaults)."""
    return dataclasses.field(default_factory=cls)


def finite(text: str) -> float:
    """An argparse type: a finite number (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


class Section:
    """Base of the config dataclasses: checks declared bounds, then ``validate()``."""
    TITLE: ClassVar[str | None] = None     # its argument group in --help; None: the main options

    def __post_init__(self) -> None:
        check(self)
        self.validate()

    def validate(self) -> None:
        """Rules that tie fields together; a ConfigError names the flags."""


def check(obj: Any) -> None:
    """Refuse a value outside its field's declared choices or bounds, naming the flag."""
    for f in dataclasses.fields(obj):
        opt = f.metadata.get("option")
        value = getattr(obj, f.name)
        if opt is None or value is None:
            continue
        name = opt.name(f.name)
        if opt.choices is not None and value not in opt.choices:
            raise ConfigError(f"{name} must be one of {', '.join(map(str, opt.choices))} (got {value!r})")
        if opt.kind in ("append", "remainder"):
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name} must be a tuple of strings (got {value!r})")
            continue
        if opt.kind == "switch":
            if not isinstance(value, bool):
                raise ConfigError(f"{name} is a switch: True or False (got {value!r})")
            continue
        number = opt.parse in (int, finite)
        if number and (isinstance(value, bool) or not isinstance(value, (int, float))
                       or (opt.parse is int and not isinstance(value, int))):
            raise ConfigError(f"{name} must be {'an integer' if opt.parse is int else 'a number'} (got {value!r})")
        if not number:
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a string (got {value!r})")
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number (got {value})")
        if opt.at_least is not None and value < opt.at_least:
            bound = "0 or more" if opt.at_least == 0 else f"at least {opt.at_least:g}"
            raise ConfigError(f"{name} must be {bound} (got {value}){opt.why}")
        if opt.above is not None and value <= opt.above:
            raise ConfigError(f"{name} must be > {opt.above:g} (got {value}){opt.why}")
        if opt.at_most is not None and value > opt.at_most:
            raise ConfigError(f"{name} must be at most {opt.at_most:g} (got {value}){opt.why}")


def options(cls: type, prefix: str = "") -> Iterator[tuple[str, type, dataclasses.Field, Option]]:
    """(dotted path, section class, field, option) of every option of ``cls``, in declaration
    order, sections depth first."""
    for f in dataclasses.fields(cls):
        if _is_section(f):
            yield from options(f.default_factory, f"{prefix}{f.name}.")
        elif "option" in f.metadata:
            yield prefix + f.name, cls, f, f.metadata["option"]


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def help_text(f: dataclasses.Field, opt: Option) -> str:
    """The option's help with its default, as --help and docs/CONFIG.md say it."""
    default = default_of(f)
    shown = opt.default_text
    if shown is None and opt.kind == "value" and default not in (None, dataclasses.MISSING):
        shown = f"{default:g}" if isinstance(default, float) else str(default)
    return opt.help + (f" (default: {shown})" if shown else "")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add every option of ``cls`` to ``parser``: a section with a TITLE becomes a group."""
    _add(parser, parser, cls, "")


def _add(parser: argparse.ArgumentParser, container: Any, cls: type, prefix: str) -> None:
    for f in dataclasses.fields(cls):
        if _is_section(f):
            sub = f.default_factory
            group = parser.add_argument_group(sub.TITLE) if sub.TITLE else container
            _add(parser, group, sub, f"{prefix}{f.name}.")
            continue
        opt = f.metadata.get("option")
        if opt is None:
            continue
        dest, text = prefix + f.name, help_text(f, opt).replace("%", "%%")
        if opt.kind == "positional":
            container.add_argument(dest, metavar=opt.metavar or f.name, help=text)
        elif opt.kind == "remainder":
            container.add_argument(dest, metavar=opt.metavar or f.name, nargs=argparse.REMAINDER, help=text)
        elif opt.kind == "switch":
            container.add_argument(*opt.names(f.name), dest=dest, action="store_true", help=text)
        else:
            kwargs: dict[str, Any] = {"dest": dest, "help": text, "default": None if opt.kind == "append"
                                      else default_of(f)}
            if opt.parse is not None:
                kwargs["type"] = opt.parse
            if opt.choices is not None:
                kwargs["choices"] = opt.choices
            else:
                kwargs["metavar"] = opt.metavar or f.name.upper()
            if opt.kind == "append":
                kwargs["action"] = "append"
            container.add_argument(*opt.names(f.name), **kwargs)


def from_namespace(cls: type, ns: argparse.Namespace, prefix: str = "") -> Any:
    """The config ``cls`` from what a parser made by ``add_arguments`` parsed (and checked)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if _is_section(f):
            kwargs[f.name] = from_namespace(f.default_factory, ns, f"{prefix}{f.name}.")
            continue
        opt = f.metadata.get("option")
        if opt is None:
            continue
        value = getattr(ns, prefix + f.name)
        if opt.kind == "append":
            value = tuple(value or ())
        elif opt.kind == "remainder":      # `script -- args`: the separator is argparse's, not the script's
            value = tuple(value[1:] if value and value[0] == "--" else value)
        kwargs[f.name] = value
    return cls(**kwargs)


def to_argv(config: Any) -> list[str]:
    """The flags that state ``config`` (its non-default options; positionals last)."""
    flags: list[str] = []
    tail: list[str] = []
    for path, _cls, f, opt in options(type(config)):
        value = config
        for part in path.split("."):
            value = getattr(value, part)
        if opt.kind == "positional":
            tail.append(str(value))
        elif opt.kind == "remainder":
            tail.extend(value)
        elif opt.kind == "switch":
            flags += [opt.name(f.name)] if value else []
        elif opt.kind == "append":
            for item in value:
                flags += [opt.name(f.name), item]
        elif value is not None and value != default_of(f):
            flags += [opt.name(f.name), repr(value) if isinstance(value, float) else str(value)]
    return [*flags, "--", *tail] if tail else flags


def _is_section(f: dataclasses.Field) -> bool:
    factory = f.default_factory
    return isinstance(factory, type) and dataclasses.is_dataclass(factory) and issubclass(factory, Section)
