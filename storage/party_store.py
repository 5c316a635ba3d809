"""One party's DuckDB database: its tables, and (through other modules) its artifacts and ledger.

A party store is opened by path only by that party's own tasks. Every write that must be
all-or-nothing happens inside one DuckDB transaction.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd

from core.ids import canonical_id
from core.preprocessing import PreprocessingSpec, prepare_raw
from storage.descriptor import TableRef, check_identifier
from storage.sources import read_source
from storage.validation import DataValidationError, validate_frame

_LOCKS: dict[Path, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()
# Open sessions of this process: database -> (the connection that keeps it open, depth).
_SESSIONS: dict[Path, tuple[duckdb.DuckDBPyConnection, int]] = {}
# database -> the number of the session holding it (a new number for every new session)
_SESSION_NUMBERS: dict[Path, int] = {}
_SESSION_COUNT = itertools.count(1)
_SESSIONS_GUARD = threading.Lock()


def owner_only_umask() -> None:
    """From now on, every file and folder this process creates is its owner's only (umask 077).

    Why process-wide: DuckDB creates a database and its write-ahead log itself, with no mode
    argument, so only the umask keeps them private from their first byte (a chmod afterwards
    leaves a window); a umask set and restored around one call would race with the process's
    other threads. A privreg process creates nothing that another user must read.
    """
    os.umask(os.umask(0o077) | 0o077)


def private_dirs(folder: Path) -> None:
    """Create ``folder`` and any missing parents readable by their owner only (0700).

    Folders that already exist are left as their owner set them.
    """
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700)


def _owner_only(path: Path) -> None:
    """Files of a party's database (the database and its write-ahead log) at 0600."""
    for file in (path, path.with_name(path.name + ".wal")):
        try:
            info = file.stat()
            if info.st_mode & 0o077 and info.st_uid == os.getuid():
                os.chmod(file, 0o600)
        except FileNotFoundError:
            continue


class PartyStore:
    """A party's private database file (0600, in folders privreg creates at 0700)."""

    def __init__(self, database: str | Path) -> None:
        self.path = Path(database)

    @classmethod
    def of(cls, ref: TableRef) -> PartyStore:
        return cls(ref.path)

    def _open(self, lock_timeout: float) -> duckdb.DuckDBPyConnection:
        """A new connection; waits while another process holds the file's lock."""
        owner_only_umask()
        private_dirs(self.path.parent)
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                con = duckdb.connect(str(self.path))
                break
            except duckdb.IOException as error:
                if "lock" not in str(error).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        _owner_only(self.path)
        return con

    @contextmanager
    def connect(self, lock_timeout: float = 30.0) -> Iterator[duckdb.DuckDBPyConnection]:
        """Open the database; waits while another process holds its write lock.

        DuckDB lets one process write a file at a time; a party's own tasks hold it only for
        a burst of storage calls (see :meth:`session`), so a reader (the CLI, a second flow)
        waits briefly.
        """
        con = self._open(lock_timeout)
        try:
            yield con
        finally:
            con.close()
            _owner_only(self.path)

    @contextmanager
    def session(self, lock_timeout: float = 30.0) -> Iterator[None]:
        """Keep the database open for a burst of storage calls in this process.

        Opening a DuckDB database costs ~25-40 ms of CPU whatever the query (and the last
        close checkpoints it), and a round of vertical LR made ~30 such calls. DuckDB shares
        one open database among a process's connections to a file, so while a session holds
        one, every :meth:`connect` and :meth:`transaction` inside costs well under a
        millisecond. Each is still its own connection and its own transaction: what commits,
        commits durably (the write-ahead log), and what rolls back leaves nothing; only the
        checkpoint waits for the session's end. Sessions nest and are shared by the process's
        threads. The file stays locked against other processes meanwhile, so a step holds a
        session around its reads or writes, never around its cryptography. A database that
        does not exist yet is not created by a session.
        """
        key = self.path.resolve()
        with _SESSIONS_GUARD:
            held = _SESSIONS.get(key)
            if held is not None:
                _SESSIONS[key] = (held[0], held[1] + 1)
        if held is None:
            if not self.path.exists():
                yield
                return
            anchor = self._open(lock_timeout)  # outside the guard: it may wait for the lock
            with _SESSIONS_GUARD:
                held = _SESSIONS.get(key)
                _SESSIONS[key] = (anchor, 1) if held is None else (held[0], held[1] + 1)
                if held is None:
                    _SESSION_NUMBERS[key] = next(_SESSION_COUNT)
            if held is not None:  # another thread opened it meanwhile: share that one
                anchor.close()
        try:
            yield
        finally:
            with _SESSIONS_GUARD:
                anchor, depth = _SESSIONS.pop(key)
                if depth > 1:
                    _SESSIONS[key] = (anchor, depth - 1)
                    anchor = None
                else:
                    _SESSION_NUMBERS.pop(key, None)
            if anchor is not None:
                anchor.close()  # the last connection: DuckDB checkpoints the log into the file
                _owner_only(self.path)

    def held_session(self) -> int | None:
        """The number of this database's open session in this process (a later session has
        another), or None when none is held."""
        with _SESSIONS_GUARD:
            return _SESSION_NUMBERS.get(self.path.resolve())

    @contextmanager
    def serialized(self) -> Iterator[None]:
        """One check-then-write at a time on this database within the process.

        DuckDB's optimistic transactions do not conflict on inserts of different keys, so two
        threads could each read the same spend and both insert; this lock orders them. Other
        processes are kept out by DuckDB's own file lock, held for the whole connection.
        """
        key = self.path.resolve()
        with _LOCKS_GUARD:
            lock = _LOCKS.setdefault(key, threading.RLock())
        with lock:
            yield

    @contextmanager
    def transaction(self, lock_timeout: float = 30.0) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection inside BEGIN/COMMIT; any exception rolls everything back."""
        with self.connect(lock_timeout) as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    # ---- tables -------------------------------------------------------------------------
    def has_table(self, table: str) -> bool:
        if not self.path.exists():
            return False
        with self.connect() as con:
            row = con.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]
            ).fetchone()
        return bool(row and row[0])

    def read_table(self, ref: TableRef, allow_missing: bool = False) -> pd.DataFrame:
        """The descriptor's columns (id, label, features) in storage order; missing feature
        cells (stored by a job that imputes) are refused unless ``allow_missing``."""
        with self.session():  # one opening of the database for the check and the read
            if not self.has_table(ref.table):
                raise DataValidationError(
                    ref.table, None, None, f"no such table in {self.path.name}"
                )
            with self.connect() as con:
                frame = con.execute(f'SELECT * FROM "{ref.table}" ORDER BY rowid').df()
        return validate_frame(frame, ref, allow_missing)

    def write_table(
        self, table: str, frame: pd.DataFrame, con: duckdb.DuckDBPyConnection | None = None
    ) -> None:
        """Create or replace ``table`` with ``frame`` (atomically when no connection is given)."""
        check_identifier(table, "table")
        if con is None:
            with self.transaction() as own:
                self.write_table(table, frame, own)
            return
        con.register("_privreg_staged", frame)
        try:
            con.execute(f'CREATE OR REPLACE TABLE "{table}" AS SELECT * FROM _privreg_staged')
        finally:
            con.unregister("_privreg_staged")

    def row_count(self, table: str) -> int | None:
        """The rows ``table`` holds, or None when there is no such table (or no database)."""
        check_identifier(table, "table")
        if not self.path.exists():
            return None
        with self.connect() as con:
            return _row_count(con, table)

    def import_frame(
        self,
        frame: pd.DataFrame,
        ref: TableRef,
        preprocessing: PreprocessingSpec | None = None,
        if_exists: str = "replace",
    ) -> int:
        """Validate ``frame`` and store it as ``ref.table``; returns the rows the table holds.

        ``if_exists`` says what becomes of a table of that name: ``"replace"`` it (a job's load
        stage: a re-run stays idempotent), ``"fail"`` (refused, naming its row count) or
        ``"append"`` the rows (their ids must be new; the combined table is validated as one).
        Validation happens before the transaction opens (the combined table's inside it), and
        the write is one transaction, so a bad input leaves the database exactly as it was.
        """
        if if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists must be one of {', '.join(IF_EXISTS)}, not {if_exists!r}")
        spec = preprocessing or PreprocessingSpec()
        keep = [c for c in (ref.id_column, ref.label_column) if c]
        frame = prepare_raw(frame, spec, keep, ref.table)  # declared missing values, categories
        allow_missing = spec.impute != "none"
        clean = validate_frame(frame, ref, allow_missing)
        with self.transaction() as con:
            rows = None if if_exists == "replace" else _row_count(con, ref.table)
            if rows is not None and if_exists == "fail":
                raise self._exists_error(ref.table, rows)
            if rows is not None:  # append
                old = con.execute(f'SELECT * FROM "{ref.table}" ORDER BY rowid').df()
                clean = _appended(old, clean, ref, allow_missing)
            self.write_table(ref.table, clean, con)
        return len(clean)

    def import_file(
        self,
        source: str | Path,
        ref: TableRef,
        preprocessing: PreprocessingSpec | None = None,
        if_exists: str = "replace",
    ) -> int:
        """Import a CSV (optionally gzipped) or Parquet file; see :meth:`import_frame`.

        A file that cannot be read is refused naming it (:func:`storage.sources.read_source`)
        before the database is opened; with ``if_exists="fail"`` an existing table is refused
        before the file is read.
        """
        if if_exists == "fail" and (rows := self.row_count(ref.table)) is not None:
            raise self._exists_error(ref.table, rows)
        frame = read_source(source, ref.table)
        return self.import_frame(frame, ref, preprocessing, if_exists)

    def _exists_error(self, table: str, rows: int) -> DataValidationError:
        return DataValidationError(
            table,
            None,
            None,
            f"already exists in {self.path.name} ({rows} rows); privreg load --replace "
            "replaces it, --append adds the file's rows to it",
        )

    def fingerprint(self, ref: TableRef) -> str:
        """A digest of the table's content, to detect that inputs are unchanged between runs.

        Read in pieces of :data:`CHUNK_ROWS` rows (:class:`Fingerprint`): memory follows the
        piece, not the table."""
        with self.session():  # one opening of the database for the check and the read
            if not self.has_table(ref.table):
                raise DataValidationError(
                    ref.table, None, None, f"no such table in {self.path.name}"
                )
            digest = Fingerprint(ref)
            with self.connect() as con:
                for _, frame in table_chunks(con, ref.table):
                    digest.update(frame)
                if digest.rows == 0:  # refused as before: "table is empty"
                    validate_frame(con.execute(f'SELECT * FROM "{ref.table}" LIMIT 0').df(), ref)
        return digest.hexdigest()


#: What :meth:`PartyStore.import_frame` may do to a table that exists already.
IF_EXISTS = ("replace", "append", "fail")


def _row_count(con: duckdb.DuckDBPyConnection, table: str) -> int | None:
    [(exists,)] = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]
    ).fetchall()
    if not exists:
        return None
    [(rows,)] = con.execute(f'SELECT count(*) FROM "{table}"').fetchall()
    return int(rows)


def _appended(
    old: pd.DataFrame, new: pd.DataFrame, ref: TableRef, allow_missing: bool
) -> pd.DataFrame:
    """The stored rows ``old`` then the validated rows ``new``, validated as one table.

    Refuses other columns, another kind of id (numbers or text), and the first new row whose
    id the table holds already (its row in the file and in the table): appending a row again
    is a mistake the combined table's own duplicate check would report at a row number of
    the combined table, not of the file.
    """
    if set(old.columns) != set(new.columns):
        raise DataValidationError(
            ref.table,
            None,
            None,
            f"the file's columns ({', '.join(map(str, new.columns))}) are not the table's "
            f"({', '.join(map(str, old.columns))}); append needs the same columns",
        )
    column = ref.id_column
    kinds = [_id_kind(frame[column]) for frame in (new, old)]
    if kinds[0] != kinds[1]:
        raise DataValidationError(
            ref.table,
            column,
            None,
            f"the file's ids are {kinds[0]}, the table's {kinds[1]}; append needs the same kind",
        )
    stored = {canonical_id(value): row for row, value in enumerate(old[column].tolist())}
    for row, value in enumerate(new[column].tolist()):
        if (twin := stored.get(canonical_id(value))) is not None:
            raise DataValidationError(
                ref.table,
                column,
                row + 1,
                f"the table holds this id already (its row {twin + 1}); append adds new ids only",
                value,
            )
    combined = pd.concat([old, new.loc[:, list(old.columns)]], ignore_index=True)
    return validate_frame(combined, ref, allow_missing)


def _id_kind(ids: pd.Series) -> str:
    return "numbers" if pd.api.types.is_numeric_dtype(ids) else "text"


#: Rows per piece when a table is read in pieces (its fingerprint, PSI's ids).
CHUNK_ROWS = 1 << 18


def table_chunks(
    con: duckdb.DuckDBPyConnection, table: str, chunk_rows: int | None = None
) -> Iterator[tuple[np.ndarray, pd.DataFrame]]:
    """``(rowids, frame)`` of every column, ``chunk_rows`` (default :data:`CHUNK_ROWS`) rowids
    at a time, in rowid order."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    top = con.execute(f'SELECT max(rowid) FROM "{table}"').fetchone()[0]
    for low in range(0, -1 if top is None else int(top) + 1, chunk_rows):
        frame = con.execute(
            f'SELECT rowid AS "__privreg_rowid", * FROM "{table}" '
            "WHERE rowid >= ? AND rowid < ? ORDER BY rowid",
            [low, low + chunk_rows],
        ).df()
        if len(frame):
            yield frame.pop("__privreg_rowid").to_numpy(np.int64), frame


class Fingerprint:
    """:meth:`PartyStore.fingerprint` fed a table's rows in order, one piece at a time: each
    row's hash depends on that row only, so the digest is the one of the whole table at once
    (SHA-256 of the row hashes of the validated frame, then the column names)."""

    def __init__(self, ref: TableRef, ids_checked: bool = False) -> None:
        self.ref, self.rows, self.columns = ref, 0, ""
        self._digest = hashlib.sha256()
        self._check_ids = not ids_checked  # the caller refuses bad ids itself (PSI does)

    def update(self, frame: pd.DataFrame) -> None:
        valid = validate_frame(frame, self.ref, allow_missing=True, check_ids=self._check_ids)
        self._digest.update(pd.util.hash_pandas_object(valid, index=False).to_numpy().tobytes())
        self.rows += len(valid)
        self.columns = ",".join(map(str, valid.columns))

    def hexdigest(self) -> str:
        digest = self._digest.copy()
        digest.update(self.columns.encode())
        return digest.hexdigest()
