"""The coordinator service's state, in one SQLite database (``DIR/coordinator.db``).

Four tables: ``hosts`` (every node agent that registered: its device slots, whether it is a
spare host, its state), ``jobs`` (what was submitted: the request, its priority and preemption
policy, its state, where it was placed, its rendezvous store, its pauses, its report), ``job_state`` (each running job's coordinator state,
``hotspare.coordinator.persist``, rewritten as it changes) and ``events`` (a log of what the
service did). Every write is one transaction, so a ``kill -9`` at any moment leaves the last
committed state; WAL mode keeps readers (``hotspare status`` answers from here) off the writer.
The service's one thread that owns a job writes that job's rows; the connection is shared
under a lock. The file is checked before it is used, and a backup of it is kept beside it
(``hotspare.service.dbcheck``): damaged state stops the service with what to do, never a
traceback and never an empty start.

The schema's version is SQLite's ``user_version`` (``VERSION``). A database of version 1 (before
priorities) is migrated in place at open, in one transaction, after its backup was made as it
was (``coordinator.db.v1``): ``jobs`` gains ``priority``, ``preemptible``, ``elastic`` and ``pauses``, each with the value
every old job had (the default class, not preemptible, not elastic, never paused). Older
services ignore the new columns. A database of a newer version is refused (``dbcheck``).
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotspare.service import dbcheck
from hotspare.service.priority import CLASSES, DEFAULT_CLASS, JobPolicy

SCHEMA = """
CREATE TABLE IF NOT EXISTS hosts (name TEXT PRIMARY KEY, devices TEXT NOT NULL, spare INTEGER NOT NULL,
                                  state TEXT NOT NULL, seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, request TEXT NOT NULL, state TEXT NOT NULL,
                                 submitted REAL NOT NULL, started REAL, ended REAL, message TEXT NOT NULL DEFAULT '',
                                 placement TEXT, store TEXT, code INTEGER, report TEXT,
                                 priority INTEGER NOT NULL DEFAULT {priority}, preemptible INTEGER NOT NULL DEFAULT 0,
                                 elastic INTEGER, pauses TEXT NOT NULL DEFAULT '[]');
CREATE TABLE IF NOT EXISTS job_state (job TEXT PRIMARY KEY, state TEXT NOT NULL, saved REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, job TEXT,
                                   what TEXT NOT NULL);
""".format(priority=CLASSES[DEFAULT_CLASS])
VERSION = dbcheck.VERSION
# version 1 -> 2: the jobs' policy and pauses (``StateDB._migrate``)
_ADDED_IN_2 = (("priority", f"INTEGER NOT NULL DEFAULT {CLASSES[DEFAULT_CLASS]}"),
               ("preemptible", "INTEGER NOT NULL DEFAULT 0"), ("elastic", "INTEGER"),
               ("pauses", "TEXT NOT NULL DEFAULT '[]'"))
# a job's life: queued until placed, running, then one of the ends; a job paused to lend its
# devices to a job of higher priority is queued again (``requeue``), to resume from its checkpoint
QUEUED, RUNNING, FINISHED, STOPPED, CANCELLED = "queued", "running", "finished", "stopped", "cancelled"
ENDED = (FINISHED, STOPPED, CANCELLED)


@dataclass(frozen=True)
class JobRow:
    id: str
    request: dict[str, Any]
    state: str
    submitted: float
    started: float | None
    ended: float | None
    message: str
    placement: dict[str, Any] | None     # {"hosts": [...], "spare_hosts": [...]}
    store: dict[str, Any] | None         # {"host", "port", "pid"}
    code: int | None
    policy: JobPolicy = JobPolicy()
    pauses: tuple[dict[str, Any], ...] = ()   # each time it was paused to lend a device (``requeue``)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "script": self.request.get("script"),
                "nodes": self.request.get("nodes"), "nproc_per_node": self.request.get("nproc_per_node"),
                "spares": self.request.get("spares"), "submitted": self.submitted, "started": self.started,
                "ended": self.ended, "message": self.message, "placement": self.placement, "code": self.code,
                **self.policy.describe(), "pauses": len(self.pauses)}


class StateDB:
    def __init__(self, directory: str | Path):
        """Open (or make) ``DIRECTORY/coordinator.db``; ``dbcheck.StateDBError`` when it is
        damaged, or cannot be opened or made."""
        self.path = Path(directory).absolute() / "coordinator.db"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise dbcheck.StateDBError(f"cannot make the state directory {self.path.parent}: {e.strerror or e}; "
                                       "give --state a directory this user may write") from None
        dbcheck.check(self.path)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._migrate()
        except sqlite3.Error as e:
            raise dbcheck.refusal(self.path, f"cannot be used ({e})") from None
        self._lock = threading.Lock()
        self._backed_up = 0.0
        self.backup()

    def _migrate(self) -> None:
        """Bring a database of an older version up to ``VERSION``, in one transaction (the
        backup of it as it was is made first, unless one exists of this very file already)."""
        (version,), = self._db.execute("PRAGMA user_version").fetchall()
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        missing = [(name, decl) for name, decl in _ADDED_IN_2 if name not in columns]
        if version >= VERSION and not missing:
            return
        if missing:
            dbcheck.make_backup(self._db, self.path, dbcheck.PRE_MIGRATION_SUFFIX)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for name, decl in missing:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")
            self._db.execute(f"PRAGMA user_version = {VERSION}")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.backup()
        with self._lock:
            self._db.close()

    def _write(self, sql: str, *params: Any) -> int:
        """One statement, its own transaction; the rows it changed."""
        with self._lock:
            return self._db.execute(sql, params).rowcount

    def backup(self) -> None:
        """A copy of the database as it is now, beside it (``dbcheck.backup_path``)."""
        with self._lock:
            dbcheck.make_backup(self._db, self.path)
            self._backed_up = time.monotonic()

    def _read(self, sql: str, *params: Any) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ hosts
    def host(self, name: str, devices: list[str], spare: bool, state: str) -> None:
        self._write("INSERT INTO hosts VALUES (?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET devices=excluded.devices, "
                    "spare=excluded.spare, state=excluded.state, seen=excluded.seen",
                    name, json.dumps(devices), int(spare), state, time.time())

    def hosts_gone(self) -> None:
        """At the service's start no agent is linked yet: every host is gone until it registers."""
        self._write("UPDATE hosts SET state='gone'")

    def host_state(self, name: str, state: str) -> None:
        self._write("UPDATE hosts SET state=?, seen=? WHERE name=?", state, time.time(), name)

    def hosts(self) -> list[dict[str, Any]]:
        return [{"name": n, "devices": json.loads(d), "spare": bool(s), "state": st, "seen": seen}
                for n, d, s, st, seen in self._read("SELECT name, devices, spare, state, seen FROM hosts ORDER BY name")]

    # ------------------------------------------------------------------ jobs
    def next_job_id(self) -> str:
        (n,), = self._read("SELECT COUNT(*) FROM jobs")
        return f"j{n + 1}"

    def submit(self, job: str, request: dict[str, Any], policy: JobPolicy = JobPolicy()) -> None:
        self._write("INSERT INTO jobs (id, request, state, submitted, priority, preemptible, elastic) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", job, json.dumps(request), QUEUED, time.time(),
                    policy.priority, int(policy.preemptible), policy.elastic)
        self.backup()

    def requeue(self, job: str, request: dict[str, Any], pause: dict[str, Any], message: str) -> bool:
        """The running ``job`` was paused to lend its devices: it is queued again with
        ``request`` (which resumes it from its checkpoint) and ``pause`` added to its pauses.
        Whether it was (a job cancelled meanwhile stays cancelled)."""
        with self._lock:
            rows = self._db.execute("SELECT pauses FROM jobs WHERE id=? AND state=?", (job, RUNNING)).fetchall()
            if not rows:
                return False
            pauses = [*json.loads(rows[0][0]), pause]
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("UPDATE jobs SET state=?, request=?, pauses=?, message=?, placement=NULL, store=NULL "
                                 "WHERE id=?", (QUEUED, json.dumps(request), json.dumps(pauses, allow_nan=False),
                                                message, job))
                self._db.execute("DELETE FROM job_state WHERE job=?", (job,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self.backup()
        return True

    def start_if_queued(self, job: str, placement: dict[str, Any], store: dict[str, Any]) -> bool:
        """The job runs there, if it is still queued (not cancelled meanwhile): whether it does."""
        placed = self._write("UPDATE jobs SET state=?, started=?, placement=?, store=? WHERE id=? AND state=?",
                             RUNNING, time.time(), json.dumps(placement), json.dumps(store), job, QUEUED) == 1
        if placed:
            self.backup()
        return placed

    def cancel_if_queued(self, job: str, message: str) -> bool:
        """The job is cancelled, if it is still queued (not placed meanwhile): whether it is."""
        cancelled = self._write("UPDATE jobs SET state=?, ended=?, message=? WHERE id=? AND state=?",
                                CANCELLED, time.time(), message, job, QUEUED) == 1
        if cancelled:
            self.backup()
        return cancelled

    def ended(self, job: str, state: str, code: int | None, message: str, report: dict[str, Any] | None) -> None:
        self._write("UPDATE jobs SET state=?, ended=?, code=?, message=?, report=? WHERE id=?",
                    state, time.time(), code, message, None if report is None else json.dumps(report), job)
        self._write("DELETE FROM job_state WHERE job=?", job)
        self.backup()

    def jobs(self, states: tuple[str, ...] | None = None) -> list[JobRow]:
        rows = self._read("SELECT id, request, state, submitted, started, ended, message, placement, store, code, "
                          "priority, preemptible, elastic, pauses FROM jobs ORDER BY submitted")
        out = [JobRow(i, json.loads(r), st, sub, sta, end, msg, json.loads(p) if p else None,
                      json.loads(s) if s else None, code, JobPolicy(prio, bool(pre), ela), tuple(json.loads(pau)))
               for i, r, st, sub, sta, end, msg, p, s, code, prio, pre, ela, pau in rows]
        return [j for j in out if states is None or j.state in states]

    def job(self, job: str) -> JobRow | None:
        return next((j for j in self.jobs() if j.id == job), None)

    def report(self, job: str) -> dict[str, Any] | None:
        rows = self._read("SELECT report FROM jobs WHERE id=?", job)
        return json.loads(rows[0][0]) if rows and rows[0][0] else None

    # ------------------------------------------------------------------ a running job's coordinator state
    def save_state(self, job: str, state: dict[str, Any], backup: bool = False) -> None:
        """``backup``: a decision of the job's coordinator changed it (the backup follows now,
        else at most every ``dbcheck.BACKUP_EVERY_S``)."""
        self._write("INSERT INTO job_state VALUES (?, ?, ?) ON CONFLICT(job) DO UPDATE SET state=excluded.state, "
                    "saved=excluded.saved", job, json.dumps(state, allow_nan=False), time.time())
        if backup or time.monotonic() - self._backed_up >= dbcheck.BACKUP_EVERY_S:
            self.backup()

    def load_state(self, job: str) -> dict[str, Any] | None:
        rows = self._read("SELECT state FROM job_state WHERE job=?", job)
        return json.loads(rows[0][0]) if rows else None

    # ------------------------------------------------------------------ the service's log
    def event(self, what: str, job: str | None = None) -> None:
        self._write("INSERT INTO events (t, job, what) VALUES (?, ?, ?)", time.time(), job, what)

    def events(self, job: str | None = None) -> list[tuple[float, str | None, str]]:
        if job is None:
            return self._read("SELECT t, job, what FROM events ORDER BY id")
        return self._read("SELECT t, job, what FROM events WHERE job=? ORDER BY id", job)
