"""Party-private artifacts (keys, model slices, releases, round checkpoints) in the party's DuckDB.

Keeping them in the party's own database means a key or a checkpoint never leaves the party,
and a release can be stored in the same transaction that charges the privacy ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb

from storage import codec
from storage.party_store import PartyStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS privreg_artifacts (
    key VARCHAR PRIMARY KEY,
    kind VARCHAR NOT NULL,
    payload BLOB NOT NULL,
    created_at TIMESTAMP NOT NULL
)
"""


_COMMITTED_TABLE = "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'privreg_artifacts'"

# database -> the number of the held session (PartyStore.held_session) that saw its table committed
_SCHEMA_SEEN: dict[Path, int] = {}
_SCHEMA_GUARD = threading.Lock()


@dataclass(frozen=True)
class Artifact:
    """One artifact to write (:meth:`ArtifactStore.put_many` writes several in one statement)."""

    key: str
    value: Any
    kind: str


class ArtifactStore:
    """Key-value artifacts of one party, serialised with the safe codec."""

    def __init__(self, store: PartyStore) -> None:
        self.store = store

    def ensure_schema(self, con: duckdb.DuckDBPyConnection) -> None:
        """Create the table if it is missing; once it is seen committed, not again while the
        process holds the database's session.

        Why: a round of a training job reads and writes a few artifacts, and DuckDB plans
        each ``CREATE TABLE IF NOT EXISTS`` anew (a third of a millisecond and more); a held
        session keeps the file open, so the table it saw committed cannot go away under it.
        Seen committed means seen by a fresh connection, outside the caller's transaction,
        which may still roll back the table it created."""
        session = self.store.held_session()
        if session is not None:
            with _SCHEMA_GUARD:
                if _SCHEMA_SEEN.get(self.store.path) == session:
                    return
        con.execute(_SCHEMA)
        if session is None:
            return
        with self.store.connect() as fresh:
            if fresh.execute(_COMMITTED_TABLE).fetchone()[0]:
                with _SCHEMA_GUARD:
                    _SCHEMA_SEEN[self.store.path] = session

    def put(
        self, key: str, value: Any, kind: str, con: duckdb.DuckDBPyConnection | None = None
    ) -> None:
        """Insert or replace ``key``; joins the caller's transaction when ``con`` is given."""
        self.put_many([Artifact(key, value, kind)], con)

    def put_many(
        self, items: Sequence[Artifact], con: duckdb.DuckDBPyConnection | None = None
    ) -> None:
        """Insert or replace every item in one statement (a round's record and checkpoint pay
        one statement's planning, not one each); joins the caller's transaction when ``con``
        is given."""
        if not items:
            return
        if len({item.key for item in items}) != len(items):
            raise ValueError("put_many: a key appears twice")
        if con is None:
            with self.store.transaction() as own:
                self.put_many(items, own)
            return
        self.ensure_schema(con)
        now = datetime.now(UTC).replace(tzinfo=None)
        rows = ", ".join(["(?, ?, ?, ?)"] * len(items))
        values: list[Any] = []
        for item in items:
            values += [item.key, item.kind, codec.dumps(item.value, codec.ARTIFACT), now]
        con.execute(f"INSERT OR REPLACE INTO privreg_artifacts VALUES {rows}", values)

    def get(
        self, key: str, default: Any = None, con: duckdb.DuckDBPyConnection | None = None
    ) -> Any:
        if con is None:
            if not self.store.path.exists():
                return default
            with self.store.connect() as own:
                return self.get(key, default, own)
        self.ensure_schema(con)
        row = con.execute("SELECT payload FROM privreg_artifacts WHERE key = ?", [key]).fetchone()
        return default if row is None else codec.loads(bytes(row[0]), codec.ARTIFACT)

    def has(self, key: str) -> bool:
        return self.get(key, default=_MISSING) is not _MISSING

    def delete_prefix(self, prefix: str, con: duckdb.DuckDBPyConnection | None = None) -> int:
        if con is None:
            with self.store.transaction() as own:
                return self.delete_prefix(prefix, own)
        self.ensure_schema(con)
        count = con.execute(
            "SELECT count(*) FROM privreg_artifacts WHERE starts_with(key, ?)", [prefix]
        ).fetchone()[0]
        con.execute("DELETE FROM privreg_artifacts WHERE starts_with(key, ?)", [prefix])
        return int(count)

    def list(
        self, prefix: str = "", con: duckdb.DuckDBPyConnection | None = None
    ) -> list[tuple[str, str, int, datetime]]:
        """(key, kind, payload bytes, created_at) of artifacts whose key starts with ``prefix``."""
        if con is None:
            if not self.store.path.exists():
                return []
            with self.store.connect() as own:
                return self.list(prefix, own)
        self.ensure_schema(con)
        rows = con.execute(
            "SELECT key, kind, octet_length(payload), created_at FROM privreg_artifacts "
            "WHERE starts_with(key, ?) ORDER BY key",
            [prefix],
        ).fetchall()
        return [(k, kind, int(size), created) for k, kind, size, created in rows]


_MISSING = object()
