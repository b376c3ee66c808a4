"""The fault grammar: ``--inject`` and ``hotspare inject`` specs, parsed into ``Fault``.

Grammar (one ``--inject`` per fault)::

    KIND:key=value[:key=value...]

A fault fires once: the replacement that later runs the same step is left alone. Triggers are
the worker's own heartbeats, acted on by the agent the moment they arrive, so a fault lands in
the middle of the step (forward, backward or the gradient exchange) or the recovery phase, as a
real one would.
"""
from __future__ import annotations

import dataclasses
import signal

from hotspare.errors import ConfigError

GRAMMAR = """\
fault injection (--inject, repeatable; steps count from 0; each fault fires once):
  kill:rank=R:step=S          SIGKILL the process of rank R as soon as it starts step S
  hang:rank=R:step=S          SIGSTOP it instead: a hang, found by heartbeat and fenced
  exit:rank=R:step=S[:code=C] the worker exits abruptly with status C (default 1), as a
                              crashing library would (its control thread calls os._exit)
  kill:rank=R:phase=join      SIGKILL rank R when it starts joining a new generation
  kill:rank=R:phase=transfer  SIGKILL rank R when it starts sending or receiving state
                              (phase faults fire during recoveries, generation 2 and later,
                              unless :gen=G names the generation; :after=S arms one only
                              once some rank has started step S)
health faults (the device under rank R degrades; the health service must react). :step=S
fires at step S, without it at the rank's first step:
  thermal:rank=R:temp=T       the simulated telemetry of R's device reads T deg C (HW thermal
                              slowdown set when T >= 90)
  ecc:rank=R:kind=K           an ECC error, K = correctable | uncorrectable (simulated telemetry)
  xid:rank=R:code=C           Xid C reported for R's device (e.g. 79 fallen off the bus, 94, 48)
  slow:rank=R:factor=F        the worker really computes F times slower from then on
  corrupt:rank=R              the worker flips a bit of one parameter value in its own memory
  nan:rank=R:step=S           the worker's gradients of step S become NaN
examples:
  --inject kill:rank=2:step=60
  --inject hang:rank=1:step=30 --inject exit:rank=3:step=80:code=7
  --inject kill:rank=0:step=10 --inject kill:rank=1:phase=transfer"""

PROCESS_FAULTS = ("kill", "hang", "exit")
DEVICE_FAULTS = ("thermal", "ecc", "xid")          # change what the simulated telemetry reads
WORKER_FAULTS = ("slow", "corrupt", "nan")         # done by the worker to itself, for real
KINDS = PROCESS_FAULTS + DEVICE_FAULTS + WORKER_FAULTS
PHASES = ("join", "transfer")
ECC_KINDS = ("correctable", "uncorrectable")
_KEYS = {"rank", "step", "code", "phase", "gen", "after", "temp", "kind", "factor"}
_INT_MAX = 2 ** 31 - 1      # steps, ranks, generations: far past any real job, still an int32
_CODE_MAX = {"exit": 255, "xid": 65535}   # a process's exit status is one byte
# kind -> (required extra keys, allowed extra keys)
_HEALTH_KEYS = {"thermal": ({"temp"}, {"temp"}), "ecc": ({"kind"}, {"kind"}), "xid": ({"code"}, {"code"}),
                "slow": ({"factor"}, {"factor"}), "corrupt": (set(), set()), "nan": ({"step"}, set())}


@dataclasses.dataclass
class Fault:
    kind: str
    rank: int
    step: int | None = None
    phase: str | None = None
    gen: int | None = None
    code: int = 1
    after: int = 0
    params: dict = dataclasses.field(default_factory=dict)   # health faults: temp, kind, factor, code
    now: bool = False          # given to a running job without a step: fires at the rank's next step
    fired: bool = False

    @property
    def target(self) -> str:
        """Who carries the fault out: "process" (a signal), "device" (telemetry), "worker"."""
        if self.kind in DEVICE_FAULTS:
            return "device"
        return "worker" if self.kind in WORKER_FAULTS else "process"

    @property
    def signal(self) -> signal.Signals | None:
        return {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}.get(self.kind)

    def __str__(self) -> str:
        if self.kind not in PROCESS_FAULTS:
            where = "".join(f":{k}={v}" for k, v in self.params.items())
            return f"{self.kind}:rank={self.rank}{where}" + (f":step={self.step}" if self.step is not None else "")
        if self.phase is not None:
            where = f"phase={self.phase}"
        elif self.step is None:          # armed on a running job: its next step
            return f"{self.kind}:rank={self.rank}" + (f":code={self.code}" if self.kind == "exit" else "")
        else:
            where = f"step={self.step}"
        extra = f":code={self.code}" if self.kind == "exit" else ""
        extra += f":gen={self.gen}" if self.gen is not None else ""
        extra += f":after={self.after}" if self.after else ""
        return f"{self.kind}:rank={self.rank}:{where}{extra}"


def parse(spec: str, world_size: int | None = None, running: bool = False) -> Fault:
    """Parse one ``--inject`` spec; raise ConfigError saying what to fix.

    ``running``: the spec goes to a running job (``hotspare inject``), where a fault without
    ``step=`` fires at the rank's next step."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--inject {spec!r}: unknown fault kind {kind!r}; known: {', '.join(KINDS)}.\n{GRAMMAR}")
    fields: dict[str, str] = {}
    for part in filter(None, rest.split(":")):
        key, eq, value = part.partition("=")
        if not eq or key not in _KEYS:
            raise ConfigError(f"--inject {spec!r}: bad field {part!r}; use key=value with keys "
                              f"{', '.join(sorted(_KEYS))}.\n{GRAMMAR}")
        fields[key] = value
    if kind not in PROCESS_FAULTS:
        return _parse_health(spec, kind, fields, world_size)
    if {"temp", "kind", "factor"} & set(fields):
        raise ConfigError(f"--inject {spec!r}: temp=, kind= and factor= go with health faults only.\n{GRAMMAR}")
    ints: dict[str, int] = {}
    for key in ("rank", "step", "code", "gen", "after"):
        if key in fields:
            try:
                ints[key] = int(fields[key])
            except ValueError:
                raise ConfigError(f"--inject {spec!r}: {key} must be an integer, got {fields[key]!r}") from None
            if ints[key] < 0:
                raise ConfigError(f"--inject {spec!r}: {key} must be >= 0")
            _in_range(spec, key, ints[key], _CODE_MAX["exit"] if key == "code" else _INT_MAX)
    phase = fields.get("phase")
    if "rank" not in ints:
        raise ConfigError(f"--inject {spec!r}: missing rank.\n{GRAMMAR}")
    if phase is None and "step" not in ints and not running:
        raise ConfigError(f"--inject {spec!r}: missing step (or phase=join|transfer).\n{GRAMMAR}")
    if world_size is not None and ints["rank"] >= world_size:
        raise ConfigError(f"--inject {spec!r}: rank {ints['rank']} does not exist (--nproc {world_size} "
                          f"gives ranks 0..{world_size - 1})")
    if phase is None and "step" not in ints:         # for a running job: at the rank's next step
        return Fault(kind, ints["rank"], None, code=ints.get("code", 1), now=True)
    if phase is not None:
        if phase not in PHASES:
            raise ConfigError(f"--inject {spec!r}: phase must be one of {', '.join(PHASES)}")
        if kind != "kill" or "step" in ints:
            raise ConfigError(f"--inject {spec!r}: phase= goes with kill and without step=")
    elif "after" in ints or "gen" in ints:
        raise ConfigError(f"--inject {spec!r}: after= and gen= only go with phase=")
    if "code" in ints and kind != "exit":
        raise ConfigError(f"--inject {spec!r}: code= only goes with exit")
    return Fault(kind, ints["rank"], ints.get("step"), phase, ints.get("gen"), ints.get("code", 1),
                 ints.get("after", 0))


def _in_range(spec: str, key: str, value: int, top: int) -> int:
    if value > top:
        what = "an exit status is 0-255" if top == _CODE_MAX["exit"] else f"at most {top}"
        raise ConfigError(f"--inject {spec!r}: {key}={value} is out of range ({what})")
    return value


def _parse_health(spec: str, kind: str, fields: dict[str, str], world_size: int | None) -> Fault:
    required, extra = _HEALTH_KEYS[kind]
    allowed = {"rank", "step"} | extra
    bad = set(fields) - allowed
    if bad:
        raise ConfigError(f"--inject {spec!r}: {kind} takes {', '.join(sorted(allowed))}, not "
                          f"{', '.join(sorted(bad))}.\n{GRAMMAR}")
    missing = ({"rank"} | required) - set(fields)
    if missing:
        raise ConfigError(f"--inject {spec!r}: missing {', '.join(sorted(missing))}.\n{GRAMMAR}")

    def integer(key: str) -> int:
        try:
            value = int(fields[key])
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: {key} must be an integer, got {fields[key]!r}") from None
        if value < 0:
            raise ConfigError(f"--inject {spec!r}: {key} must be >= 0")
        return _in_range(spec, key, value, _CODE_MAX["xid"] if key == "code" else _INT_MAX)

    rank = integer("rank")
    if world_size is not None and rank >= world_size:
        raise ConfigError(f"--inject {spec!r}: rank {rank} does not exist (--nproc {world_size} "
                          f"gives ranks 0..{world_size - 1})")
    params: dict = {}
    if kind == "thermal":
        try:
            params["temp"] = float(fields["temp"])
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: temp must be a number of deg C, got {fields['temp']!r}") from None
        if not 0 < params["temp"] < 200:
            raise ConfigError(f"--inject {spec!r}: temp {params['temp']} is not a plausible temperature (0-200 C)")
    elif kind == "ecc":
        if fields["kind"] not in ECC_KINDS:
            raise ConfigError(f"--inject {spec!r}: kind must be one of {', '.join(ECC_KINDS)}")
        params["kind"] = fields["kind"]
    elif kind == "xid":
        params["code"] = integer("code")
    elif kind == "slow":
        try:
            params["factor"] = float(fields["factor"])
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: factor must be a number, got {fields['factor']!r}") from None
        if not 1.0 < params["factor"] <= 100:
            raise ConfigError(f"--inject {spec!r}: factor must be > 1 (how many times slower) and <= 100")
    step = integer("step") if "step" in fields else None
    return Fault(kind, rank, step, params=params)
