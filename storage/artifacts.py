"""Party-private artifacts (keys, model slices, releases, round checkpoints) in the party's DuckDB.

Keeping them in the party's own database means a key or a checkpoint never leaves the party,
and a release can be stored in the same transaction that charges the privacy ledger.
"""

from __future__ import annotations

from datetime import UTC, datetime
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


class ArtifactStore:
    """Key-value artifacts of one party, serialised with the safe codec."""

    def __init__(self, store: PartyStore) -> None:
        self.store = store

    @staticmethod
    def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
        con.execute(_SCHEMA)

    def put(
        self, key: str, value: Any, kind: str, con: duckdb.DuckDBPyConnection | None = None
    ) -> None:
        """Insert or replace ``key``; joins the caller's transaction when ``con`` is given."""
        if con is None:
            with self.store.transaction() as own:
                self.put(key, value, kind, own)
            return
        self.ensure_schema(con)
        con.execute(
            "INSERT OR REPLACE INTO privreg_artifacts VALUES (?, ?, ?, ?)",
            [key, kind, codec.dumps(value, codec.ARTIFACT), datetime.now(UTC).replace(tzinfo=None)],
        )

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
