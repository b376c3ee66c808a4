"""Where the device registry's document lives (``hotspare.health.registry``): a JSON file, or
a row of a SQLite database.

Both hold the same text (the registry's JSON document) and give the registry the same two
things: ``read()`` (the text, None while there is none yet; no lock) and ``exclusive()``, a
transaction that reads the text, may write a new one, and excludes every other writer, in
this process and in others, until it ends:

* ``FileStore``: ``<path>.lock`` held with ``fcntl``; a write goes to a temporary file in the
  same directory, fsynced and ``os.replace``d over the old one, so a reader sees the old file
  or the new one, never half of one.
* ``SqliteStore`` (a path ending in ``.db`` or ``.sqlite``): the table ``health_registry`` of
  that database, e.g. the coordinator service's ``DIR/coordinator.db``, so that the service's
  device health is in its database with the rest of its state. ``BEGIN IMMEDIATE`` excludes
  other writers; a transaction that raises is rolled back.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Protocol

SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
BUSY_TIMEOUT_S = 30.0


class StoreError(OSError):
    """The store cannot be read or written (the registry says which and why)."""


class Transaction(Protocol):
    def read(self) -> str | None: ...
    def write(self, text: str) -> None: ...


class FileStore:
    def __init__(self, path: Path):
        self.path = path

    def stamp(self) -> tuple[int, ...] | None:
        """What identifies the file's present version without reading it (inode, times, size:
        every write renames a new file over it); None when it cannot be had."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size

    def read(self) -> str | None:
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise StoreError(f"cannot read it: {e}") from None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[Transaction]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_name(self.path.name + ".lock"), "a")
        except OSError as e:
            raise StoreError(f"cannot open its lock: {e}") from None
        with lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield self

    def write(self, text: str) -> None:
        try:
            mode = self.path.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
        try:                                    # EMFILE, ENOSPC, a read-only directory
            self._replace(text, mode)
        except OSError as e:
            raise StoreError(f"cannot write it: {e}") from None
        with contextlib.suppress(OSError):      # make the rename itself durable
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _replace(self, text: str, mode: int) -> None:
        """Write `text` to a temporary file beside the store and rename it over the store."""
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


class SqliteStore:
    """One connection per store, shared by this process's threads under a lock."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("CREATE TABLE IF NOT EXISTS health_registry "
                             "(id INTEGER PRIMARY KEY CHECK (id = 1), doc TEXT NOT NULL)")
            except sqlite3.Error as e:
                raise StoreError(f"cannot open it as a SQLite database: {e}") from None
            self._conn = conn
        return self._conn

    def read(self) -> str | None:
        with self._lock:
            try:
                row = self._connection().execute("SELECT doc FROM health_registry WHERE id = 1").fetchone()
            except sqlite3.Error as e:
                raise StoreError(f"cannot read it: {e}") from None
        return None if row is None else str(row[0])

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[Transaction]:
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise StoreError(f"cannot lock it for writing: {e}") from None
            try:
                yield self
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as e:
                raise StoreError(f"cannot write it: {e}") from None

    def write(self, text: str) -> None:
        try:
            self._connection().execute("INSERT OR REPLACE INTO health_registry (id, doc) VALUES (1, ?)", (text,))
        except sqlite3.Error as e:
            raise StoreError(f"cannot write it: {e}") from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def store_for(path: Path) -> FileStore | SqliteStore:
    """The store of a registry at ``path``: SQLite for a database file, else JSON."""
    return SqliteStore(path) if path.suffix in SQLITE_SUFFIXES else FileStore(path)
