"""The service's database checked at open, and the backup it keeps of it.

A service that starts on damaged state either dies in a traceback or, worse, runs on as if it
had no jobs: every queued job and every running job's coordinator state gone without a word.
So before the service uses ``DIR/coordinator.db`` it checks it: the file is not empty, SQLite
finds it sound (``PRAGMA quick_check``), it holds the service's tables, and every JSON value in
them decodes to what the service reads there. Anything else stops the service at start with a
``StateDBError`` naming the file, what is wrong, and what to do: restore the backup, or move the
file away to start with no state.

The backup is ``DIR/coordinator.db.backup``, made with SQLite's online backup API (a consistent
copy while the service runs) into a temporary file renamed over the last one, so a crash in the
middle of a backup leaves the previous backup whole. ``StateDB`` makes one at every change of a
job's state (submitted, started, ended, cancelled) and at most every ``BACKUP_EVERY_S`` while
jobs save their coordinator state.

A database of a newer schema (SQLite's ``user_version`` above ``VERSION``) is refused: this
service would misread it. One of an older schema is checked as it is (the columns it has) and
migrated by ``StateDB``, which keeps a copy of it as it was (``PRE_MIGRATION_SUFFIX``).
"""
from __future__ import annotations

import json
import os
import shlex
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

from hotspare.errors import ConfigError

BACKUP_SUFFIX = ".backup"
PRE_MIGRATION_SUFFIX = ".v1"      # the database as it was before its migration to version 2
VERSION = 2                       # 1: before priorities (no user_version set); 2: jobs' policy and pauses
BACKUP_EVERY_S = 30.0
TABLES = ("hosts", "jobs", "job_state", "events")


class StateDBError(ConfigError):
    """The service's database cannot be used; the message names the file and what to do."""


def backup_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def make_backup(db: sqlite3.Connection, path: Path, suffix: str = BACKUP_SUFFIX) -> None:
    """A consistent copy of the open database ``db`` (of file ``path``) beside it (``path`` +
    ``suffix``), replacing the last one only once it is complete."""
    target = path.with_name(path.name + suffix)
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    copy = sqlite3.connect(tmp)
    try:
        db.backup(copy)
    finally:
        copy.close()
    os.replace(tmp, target)


def _dict_with(keys: dict[str, type]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(v.get(k), t) for k, t in keys.items())


_REQUEST = _dict_with({"script": str, "args": list, "nodes": int, "nproc_per_node": int, "spares": int})
_OBJECT_OR_NULL = lambda v: v is None or isinstance(v, dict)   # noqa: E731
# (table, key column, JSON column, may be NULL, what its value must be)
_JSON_COLUMNS = (
    ("jobs", "id", "request", False, _REQUEST),
    ("jobs", "id", "placement", True, _dict_with({"hosts": list, "spare_hosts": list})),
    ("jobs", "id", "store", True, _dict_with({"host": str, "port": int})),
    ("jobs", "id", "report", True, _OBJECT_OR_NULL),
    ("job_state", "job", "state", False, lambda v: isinstance(v, dict)),
    ("hosts", "name", "devices", False, lambda v: isinstance(v, list)),
    ("jobs", "id", "pauses", False, lambda v: isinstance(v, list) and all(isinstance(p, dict) for p in v)),
)
_INTEGER_COLUMNS = (("jobs", "id", "priority", False), ("jobs", "id", "preemptible", False),
                    ("jobs", "id", "elastic", True))


def problem(path: Path, mode: str = "rw") -> str | None:
    """What is wrong with the database file ``path`` (None: nothing; it must exist). ``mode``:
    ``ro`` for a backup, never written (the database itself is opened as the service will,
    which recovers what a ``kill -9`` left in its write-ahead log)."""
    if path.stat().st_size == 0:
        return "is empty (0 bytes)"
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode={mode}", uri=True)
    except sqlite3.Error as e:
        return f"cannot be opened ({e})"
    try:
        verdict = db.execute("PRAGMA quick_check").fetchall()
        if verdict != [("ok",)]:
            return f"is damaged (SQLite's check: {'; '.join(str(r[0]) for r in verdict[:3])[:300]})"
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        missing = [t for t in TABLES if t not in tables]
        if missing:
            return f"is not a coordinator service's database (no table {', '.join(missing)})"
        (version,), = db.execute("PRAGMA user_version").fetchall()
        if version > VERSION:
            return (f"was written by a newer hotspare (schema {version}; this one reads up to {VERSION}): run the "
                    "hotspare that wrote it")
        columns = {t: {row[1] for row in db.execute(f"PRAGMA table_info({t})")} for t in TABLES}
        for table, key, column, nullable in _INTEGER_COLUMNS:
            if column not in columns[table]:
                continue                 # an older schema's database: migrated at open
            for name, value in db.execute(f"SELECT {key}, {column} FROM {table}"):
                if not (isinstance(value, int) or (value is None and nullable)):
                    return f"holds a bad row: {table} {str(name)[:64]!r}, its {column} is not what the service wrote"
        for table, key, column, nullable, ok in _JSON_COLUMNS:
            if column not in columns[table]:
                continue
            for name, raw in db.execute(f"SELECT {key}, {column} FROM {table}"):
                if raw is None and nullable:
                    continue
                try:
                    value = json.loads(raw)
                except (TypeError, ValueError, RecursionError):
                    value = ok              # never what ``ok`` accepts
                if value is ok or not ok(value):
                    return f"holds a bad row: {table} {str(name)[:64]!r}, its {column} is not what the service wrote"
        if "health_registry" in tables:
            for (doc,) in db.execute("SELECT doc FROM health_registry"):
                if not _health_ok(doc):
                    return "holds a bad row: health_registry, its doc is not the device registry the service wrote"
    except sqlite3.Error as e:
        return f"is damaged ({e})"
    finally:
        db.close()
    return None


def _health_ok(doc: Any) -> bool:
    """The device registry's document (``hotspare.health.registry``), as it reads it."""
    from hotspare.health.records import record_from_json
    from hotspare.health.registry import FORMAT
    try:
        data = json.loads(doc)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return False
        int(data["revision"])
        for device, record in data["devices"].items():
            record_from_json(device, record)
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
        return False
    return True


def _describe_backup(path: Path) -> tuple[str | None, str]:
    """(None, how it is) for a usable backup, else (why not, '')."""
    if not path.exists():
        return "there is none", ""
    why = problem(path, mode="ro")
    if why is not None:
        return f"{path} {why}", ""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        (jobs,), = db.execute("SELECT COUNT(*) FROM jobs").fetchall()
    finally:
        db.close()
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(path.stat().st_mtime))
    return None, f"made {when}, {jobs} job(s)"


def refusal(path: Path, what: str) -> StateDBError:
    """The error that stops the service: the file, ``what`` is wrong, what to do."""
    backup = backup_path(path)
    unusable, how = _describe_backup(backup)
    head = (f"the coordinator service's database {path} {what}. The service does not start on it: it would "
            "lose or misread its jobs.")
    fresh = (f"move {path} away (and {path.name}-wal, {path.name}-shm beside it, if there) to start with no state: "
             "every job and host it knew is forgotten.")
    if unusable is not None:
        return StateDBError(f"{head} No usable backup to restore ({unusable}): {fresh}")
    q = {name: shlex.quote(str(p)) for name, p in (("db", path), ("damaged", f"{path}.damaged"), ("wal", f"{path}-wal"),
                                                     ("shm", f"{path}-shm"), ("backup", backup))}
    return StateDBError(
        f"{head} Restore the backup the service keeps ({backup}, {how}; later changes are lost): with the "
        f"service stopped, run\n  mv {q['db']} {q['damaged']} && rm -f {q['wal']} {q['shm']} && cp {q['backup']} "
        f"{q['db']}\n"
        f"then start the service again. Or {fresh}")


def check(path: Path) -> None:
    """Refuse (``StateDBError``) a database ``path`` the service must not start on. A missing
    one is a new service's, unless a backup is there: then it was lost."""
    if not path.exists():
        if backup_path(path).exists():
            raise refusal(path, "is missing, but a backup of it is there")
        return
    what = problem(path)
    if what is not None:
        raise refusal(path, what)
