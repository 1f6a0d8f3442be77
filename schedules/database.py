"""Tuning results on disk: what a result is valid for (:class:`TuningKey`) and the SQLite
store that keeps them (:class:`Database`).

One SQLite file (:data:`FILE_NAME` in a work directory) maps each key's text to a record: the
kept configuration and whatever the tuner noted of its measurements.  The same operator on
the same machine then costs nothing the second time.

The store is safe to share: every write is one SQLite transaction (WAL journal, a busy
timeout), so tuners and compiles in several processes, and threads of one process, on one
work directory never lose or corrupt each other's entries.  Nothing read is trusted: a
record is checked through the operator registry (:data:`~schedules.ops.OPS`) when it is
read, and against the problem when one is given; a bad record is deleted (its operator is
then tuned again) with one warning line naming the file.  A file that is no tuning database
(random bytes, a damaged or foreign SQLite file) is renamed aside (``<name>.corrupt``), the
user is told in one line, and an empty database takes its place.  The JSON file of earlier
versions (:data:`LEGACY_NAME`) is migrated once: its valid records are imported and it is
renamed ``tuning.json.migrated``.

Warnings go to the ``schedules.database`` logger (without logging configured, Python prints
them to stderr as the bare line).

Examples
--------
>>> from schedules.gemm import GemmConfig
>>> key = TuningKey("dense", (48, 64, 96), "", "float32", "", "avx2/haswell/1t")
>>> import tempfile, pathlib
>>> db = Database(pathlib.Path(tempfile.mkdtemp()) / FILE_NAME)
>>> db.put(key, GemmConfig.of("BCa", 48, 64, 96), gflops=80.0)
>>> db.get(key).spec, db.record(key)["gflops"], len(db)
('BCa', 80.0, 1)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from microkernels.machine import machine_of

from .ops import OPS, Config, Problem, op_of, shape_text

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["TuningKey", "Database", "StoreError", "FILE_NAME", "LEGACY_NAME", "check_config"]

#: The database's file name in a work directory.
FILE_NAME = "tuning.db"
#: The JSON database of earlier versions, migrated when found next to the SQLite file.
LEGACY_NAME = "tuning.json"
#: Identifies a tvm-tpp tuning database among SQLite files (``PRAGMA application_id``).
_APPLICATION_ID = 0x54505031  # "TPP1"
#: The record format; a file of another version is set aside, never guessed at.
_SCHEMA_VERSION = 1
_SQLITE_NOTADB, _SQLITE_CORRUPT = 26, 11  # SQLite's result codes
#: Seconds a writer waits for another process's transaction before failing.
_BUSY_SECONDS = 120.0

log = logging.getLogger(__name__)
#: (database path, key) pairs whose stale record was reported (once per process).
_WARNED_STALE: set[tuple[str, str]] = set()


class StoreError(ValueError):
    """The database file cannot be opened, read or written (locked past the busy timeout,
    read-only, a full disk): the message names it."""


@dataclass(frozen=True)
class TuningKey:
    """What a tuning result is valid for.

    ``shape`` holds the operator's sizes (dense ``m, n, k``; conv ``n, c, h, w, k, r, s``;
    batch GEMM ``batch, m, n, k``) and ``layout`` whatever else sets two problems of those
    sizes apart (conv strides and padding, batch-GEMM operand layouts, "" for dense), so
    dense keys read as they always did.  ``target`` is the machine's
    :attr:`~microkernels.machine.Machine.key`.

    Examples
    --------
    >>> TuningKey("dense", (48, 64, 96), "", "float32", "bias", "avx2/haswell/1t").text()
    'dense|48x64x96|float32|bias|avx2/haswell/1t'
    """

    op: str
    shape: tuple[int, ...]
    layout: str
    dtype: str
    epilogue: str
    target: str

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; the tuner handles {', '.join(OPS)}")

    @classmethod
    def of(cls, problem: Problem, target: Target) -> TuningKey:
        """The key of ``problem`` on the machine of ``target`` (a ``tpp`` target)."""
        op = op_of(problem)
        shape, layout, dtype = op.key(problem)
        return cls(op.name, shape, layout, dtype, problem.epilogue.name,
                   machine_of(target).key)

    def text(self) -> str:
        return (f"{self.op}|{shape_text(self.shape, self.layout)}|{self.dtype}|"
                f"{self.epilogue}|{self.target}")


def check_config(problem: Problem, config: Config, isa: str | None = None) -> None:
    """ValueError unless ``config`` is a configuration of ``problem``'s operator that tiles it
    (and, given the ``isa``, schedules it: its loop_spec parses, its packing fits).

    Examples
    --------
    >>> from schedules.gemm import GemmConfig, GemmProblem
    >>> check_config(GemmProblem(48, 64, 96), GemmConfig.of("BCa", 48, 64, 96))
    >>> check_config(GemmProblem(48, 64, 96), GemmConfig.of("BCa", 40, 64, 96))
    Traceback (most recent call last):
    ...
    ValueError: bm=40 does not divide 48
    """
    op = op_of(problem)
    if not isinstance(config, op.config):
        raise ValueError(f"a {op.name} record holds a {type(config).__name__}")
    try:
        config.check(problem)
        if isa is not None:
            op.schedule(problem, config, isa)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as err:
        first = str(err).strip().splitlines()
        raise ValueError(first[0] if first else type(err).__name__) from None


def _config_of(op_name: str, record: object) -> Config:
    """The configuration a stored record holds; ValueError naming what is wrong with it."""
    if op_name not in OPS:
        raise ValueError(f"unknown op {op_name!r}")
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ValueError("the record holds no config object")
    op = OPS[op_name]
    try:
        config = op.from_json(record["config"])
        if not isinstance(config, op.config):
            raise TypeError(f"not a {op.config.__name__}")
        op.text(config)  # every field readable
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        what = (f"missing field {err}" if isinstance(err, KeyError) else str(err)).strip()
        raise ValueError(f"bad config: {what.splitlines()[0] if what else type(err).__name__}"
                         ) from None
    return config


def _key_op(key: object) -> str:
    """The op of a key text (``op|shape|dtype|epilogue|machine``); ValueError if malformed."""
    if not isinstance(key, str) or key.count("|") != 4:
        raise ValueError(f"malformed key {key!r}")
    return key.split("|", 1)[0]


def _aside(path: Path, suffix: str) -> Path:
    """Rename ``path`` to the first free ``<name>.<suffix>[.N]`` beside it."""
    for n in range(1000):
        target = path.with_name(f"{path.name}.{suffix}" + (f".{n}" if n else ""))
        if not target.exists():
            path.replace(target)
            return target
    raise OSError(f"cannot set {path} aside: too many {suffix} copies")


class Database:
    """Tuning results in one SQLite file, shared safely by processes and threads.

    Parameters
    ----------
    path
        The SQLite file; its directory and the file are created on the first :meth:`put`.
        A file there that is no tuning database is renamed aside (one warning line) and
        replaced by an empty one; a JSON database of earlier versions at ``path`` is migrated.
    legacy
        A JSON database of earlier versions to migrate once, if it exists: its valid records
        are imported (where ``path`` has none for their key) and it is renamed
        ``<name>.migrated``.  Default: :data:`LEGACY_NAME` beside ``path``.

    Raises
    ------
    ValueError
        ``path``'s directory is a file.
    StoreError
        The database cannot be opened (permissions, a full disk); also from the methods.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> work = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (work / "tuning.json").write_text('{"dense|1x1x1|float32||x": {"config": 42}}')
    >>> len(Database(work / FILE_NAME)), [p.name for p in work.glob("tuning.json*")]
    (0, ['tuning.json.migrated'])
    """

    def __init__(self, path: str | os.PathLike, legacy: str | os.PathLike | None = None
                 ) -> None:
        self.path = Path(path)
        self.legacy = Path(legacy) if legacy is not None else self.path.with_name(LEGACY_NAME)
        if self.legacy == self.path:
            self.legacy = None
        self._local = threading.local()
        self._opened = False
        self._open_lock = threading.Lock()
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise ValueError(f"{self.path.parent} is a file, not a work directory")
        if self.path.exists() and not self.path.is_file():
            raise ValueError(f"tuning database {self.path} is not a file")
        if self.path.exists() or (self.legacy is not None and self.legacy.is_file()):
            self._open()

    # -- opening: checks, setting aside, migration ---------------------------------------

    def _open(self) -> None:
        """Check the file, set it aside if it is none of ours, create the schema, migrate the
        legacy JSON file: once per process, under an exclusive lock of the directory so that
        processes opening at once agree on what they found."""
        with self._open_lock:
            if self._opened:
                return
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise ValueError(f"{self.path.parent} is a file, not a work directory") from None
            except OSError as err:
                raise ValueError(f"cannot create {self.path.parent}: {err.strerror}") from None
            try:
                with self._directory_lock():
                    self._check_file()
                    self._create_schema()
                    if self.legacy is not None and self.legacy.is_file():
                        self._migrate(self.legacy)
            except (sqlite3.Error, OSError) as err:  # read-only, full disk, ...
                what = err.strerror if isinstance(err, OSError) and err.strerror else err
                raise StoreError(f"cannot open tuning database {self.path}: {what}") from None
            self._opened = True

    @contextlib.contextmanager
    def _directory_lock(self) -> Iterator[None]:
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _check_file(self) -> None:
        """Set the file aside unless it is an intact tuning database (or empty/absent).

        The file is read through SQLite: closing any other descriptor of it would drop the
        POSIX locks this process's connections hold on it (SQLite's documented way to
        corrupt a database), so Python reads it only once SQLite has said it is no database.
        """
        if self.path.is_file() and self.path.stat().st_size > 0:
            problem = self._sqlite_problem()
            if problem == "not a database":
                legacy = self._legacy_records(self.path)
                if legacy is None:
                    self._set_aside("is not a tuning database")
                else:  # a JSON database of earlier versions, by the name given
                    moved = _aside(self.path, "migrated")
                    self._create_schema()
                    self._import(legacy, self.path, moved)
            elif problem is not None:
                self._set_aside(problem)

    def _sqlite_problem(self) -> str | None:
        """What is wrong with the file as a tuning database, or None."""
        try:
            conn = sqlite3.connect(self.path, timeout=_BUSY_SECONDS)
            try:
                application, version = (conn.execute(f"PRAGMA {p}").fetchone()[0]
                                        for p in ("application_id", "user_version"))
                tables = {r[0] for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type='table'")}
                if (application, version) != (_APPLICATION_ID, _SCHEMA_VERSION):
                    if not tables and not application:
                        return None  # an empty SQLite file: the schema comes next
                    return ("is another SQLite database" if application != _APPLICATION_ID
                            else f"has record format {version}, this version reads "
                            f"{_SCHEMA_VERSION}")
                check = conn.execute("PRAGMA quick_check").fetchone()[0]
                return None if check == "ok" else f"is damaged ({check})"
            finally:
                conn.close()
        except sqlite3.DatabaseError as err:
            code = getattr(err, "sqlite_errorcode", None)
            if code == _SQLITE_NOTADB:
                return "not a database"
            if code == _SQLITE_CORRUPT or "malformed" in str(err):
                return f"is damaged ({err})"
            # Locked past the busy timeout, unreadable, ...: nothing to set aside.
            raise StoreError(f"cannot open tuning database {self.path}: {err}") from None

    def _set_aside(self, problem: str) -> None:
        moved = _aside(self.path, "corrupt")
        for extra in ("-wal", "-shm"):  # a damaged file's journal belongs to it
            journal = self.path.with_name(self.path.name + extra)
            if journal.exists():
                journal.replace(moved.with_name(moved.name + extra))
        log.warning(f"tuning database {self.path} {problem}: moved it to {moved.name} and "
                    "started an empty one (its operators will be tuned again)")

    def _create_schema(self) -> None:
        conn = self._connection()
        with self._transaction(conn):
            conn.execute("CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, "
                         "op TEXT NOT NULL, record TEXT NOT NULL)")
            conn.execute(f"PRAGMA application_id = {_APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")

    @staticmethod
    def _legacy_records(path: Path) -> dict | None:
        """The records of a JSON database, or None if the file is no JSON object."""
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def _migrate(self, legacy: Path) -> None:
        records = self._legacy_records(legacy)
        if records is None:
            moved = _aside(legacy, "corrupt")
            log.warning(f"old tuning database {legacy} is not a JSON object of records: "
                        f"moved it to {moved.name} (its operators will be tuned again)")
            return
        self._import(records, legacy, _aside(legacy, "migrated"))

    def _import(self, records: dict, source: Path, moved: Path) -> None:
        good, bad = {}, []
        for key, record in records.items():
            try:
                op = _key_op(key)
                _config_of(op, record)
                good[key] = (op, json.dumps(record, sort_keys=True))
            except (ValueError, TypeError):  # TypeError: a record JSON cannot write back
                bad.append(key)
        conn = self._connection()
        with self._transaction(conn):
            conn.executemany("INSERT OR IGNORE INTO records (key, op, record) VALUES (?, ?, ?)",
                             [(k, op, text) for k, (op, text) in good.items()])
        dropped = f", dropped {len(bad)} invalid (to be tuned again)" if bad else ""
        log.warning(f"migrated {len(good)} tuning records from {source} into "
                    f"{self.path}{dropped}; the old file is now {moved.name}")

    # -- connections -----------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (SQLite connections are not shared between threads)."""
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            try:
                conn = sqlite3.connect(self.path, timeout=_BUSY_SECONDS, isolation_level=None)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.DatabaseError as err:
                raise StoreError(f"cannot open tuning database {self.path}: {err}") from None
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    @staticmethod
    @contextlib.contextmanager
    def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
        conn.execute("BEGIN IMMEDIATE")  # the write lock now: no upgrade deadlock later
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _ready(self) -> sqlite3.Connection | None:
        """The connection, or None while there is no file (nothing stored yet)."""
        if not self._opened:
            if not self.path.exists():
                return None
            self._open()
        return self._connection()

    def _query(self, sql: str, *args: object) -> list[tuple]:
        conn = self._ready()
        if conn is None:
            return []
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as err:
            raise StoreError(f"tuning database {self.path} cannot be read: {err}") from None

    def close(self) -> None:
        """Close this thread's connection (the last one to close folds the journal into the
        file); the database opens again on the next use."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            conn.close()

    # -- records -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._query("SELECT COUNT(*) FROM records")[0][0] if self._ready() else 0

    def keys(self) -> list[str]:
        """The stored keys' texts, sorted."""
        return [k for (k,) in self._query("SELECT key FROM records ORDER BY key")]

    def _read(self, key: TuningKey) -> tuple[dict, Config, str] | None:
        rows = self._query("SELECT op, record FROM records WHERE key = ?", key.text())
        if not rows:
            return None
        op, text = rows[0]
        try:
            record = json.loads(text)
            if op != key.op:
                raise ValueError(f"stored as a {op!r} record")
            return record, _config_of(op, record), text
        except ValueError as err:
            self._drop(key, text, str(err))
            return None

    def _drop(self, key: TuningKey, text: str, why: str) -> None:
        """Delete a bad record (unless another writer replaced it meanwhile) and say so."""
        conn = self._connection()
        with self._transaction(conn):
            conn.execute("DELETE FROM records WHERE key = ? AND record = ?", (key.text(), text))
        log.warning(f"tuning database {self.path}: dropped the invalid record of "
                    f"{key.text()} ({why}); it will be tuned again")

    def get(self, key: TuningKey, problem: Problem | None = None, isa: str | None = None,
            default: Config | None = None) -> Config | None:
        """The configuration kept for ``key``, or None (also for a record found invalid, which
        is deleted).  Given the ``problem`` (and the ``isa`` to schedule it for), the record
        must also fit it (:func:`check_config`).  Given today's ``default``, a record tuned
        against another default is stale (its winner beat only that one, which later code
        replaced): None, the record kept, with one warning per key (see :meth:`stale`)."""
        found = self._read(key)
        if found is None:
            return None
        record, config, text = found
        if problem is not None:
            try:
                check_config(problem, config, isa)
            except ValueError as err:
                self._drop(key, text, f"does not fit its operator: {err}")
                return None
        if default is not None and self.stale(key, record, default):
            return None
        return config

    def stale(self, key: TuningKey, record: dict, default: Config) -> bool:
        """Whether ``record`` was tuned against a default other than ``default``: its first
        measurement (the tuner's default then) names another configuration.  Records without
        measurements (put by hand) are never stale."""
        measured = record.get("measured")
        first = measured[0] if isinstance(measured, list) and measured else None
        then = first.get("config") if isinstance(first, dict) else None
        if then is None or then == OPS[key.op].to_json(default):
            return False
        if (str(self.path), key.text()) not in _WARNED_STALE:
            _WARNED_STALE.add((str(self.path), key.text()))
            log.warning(f"tuning database {self.path}: {key.text()} was tuned against an "
                        "older default configuration; the current default is used until it "
                        "is tuned again")
        return True

    def record(self, key: TuningKey) -> dict | None:
        """The stored record (config, measured GFLOPS, tuning seconds, measurements), or None."""
        found = self._read(key)
        return found[0] if found is not None else None

    def put(self, key: TuningKey, config: Config, **details: object) -> None:
        """Keep ``config`` for ``key`` with ``details`` (JSON values), in one transaction."""
        text = json.dumps({"config": OPS[key.op].to_json(config), **details}, sort_keys=True)
        if not self._opened:
            self._open()
        conn = self._connection()
        try:
            with self._transaction(conn):
                conn.execute("INSERT INTO records (key, op, record) VALUES (?, ?, ?) "
                             "ON CONFLICT(key) DO UPDATE SET op = excluded.op, "
                             "record = excluded.record", (key.text(), key.op, text))
        except sqlite3.DatabaseError as err:
            raise StoreError(f"tuning database {self.path} cannot be written: {err}") from None
