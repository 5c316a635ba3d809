"""The data owner's policy for its tables, kept in its own DuckDB and set only through the CLI.

Two kinds of facts live here:

* **lineage**: an aligned copy (``patients_aligned``) records the table its rows come from, so
  budgets and permissions are those of the source table, whichever copy a flow reads;
* **permissions**: whether a table's rows may be released without noise (tests, audits) or
  sent raw to a coordinator (the pooled reference). Both default to *no*.

A flow never writes a permission: it only asks :meth:`OwnerPolicy.require`, which refuses
naming the party and table. The privacy budget itself lives in :mod:`storage.ledger`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime

import duckdb

from storage.descriptor import check_identifier
from storage.party_store import PartyStore

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS privreg_lineage (
        derived_table VARCHAR PRIMARY KEY,
        source_table VARCHAR NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS privreg_policy (
        source_table VARCHAR PRIMARY KEY,
        allow_noiseless_release BOOLEAN NOT NULL,
        allow_raw_export BOOLEAN NOT NULL,
        updated_at TIMESTAMP NOT NULL)""",
]
PERMISSIONS = ("allow_noiseless_release", "allow_raw_export")


class PolicyError(ValueError):
    """A flow asked for something its data owner's policy does not allow."""


@dataclass(frozen=True)
class TablePolicy:
    """What the owner allows for one source table (everything off by default)."""

    table: str
    allow_noiseless_release: bool = False
    allow_raw_export: bool = False

    def as_dict(self) -> dict[str, str | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class OwnerPolicy:
    """Lineage and permissions of the tables in one party's database."""

    def __init__(self, store: PartyStore) -> None:
        self.store = store

    @staticmethod
    def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
        for statement in _SCHEMA:
            con.execute(statement)

    # ---- lineage ----------------------------------------------------------------------------
    def record_source(self, derived: str, source: str, con: duckdb.DuckDBPyConnection) -> None:
        """``derived`` holds rows of ``source`` (joins the caller's transaction)."""
        self.ensure_schema(con)
        root = self.source_of(source, con)
        if root == derived:
            raise PolicyError(f"table {derived!r} cannot be derived from itself")
        con.execute("INSERT OR REPLACE INTO privreg_lineage VALUES (?, ?)", [derived, root])

    def source_of(self, table: str, con: duckdb.DuckDBPyConnection | None = None) -> str:
        """The table whose rows ``table`` holds: itself, unless it is a recorded copy."""
        if con is None:
            if not self.store.path.exists():
                return table
            with self.store.connect() as own:
                return self.source_of(table, own)
        self.ensure_schema(con)
        row = con.execute(
            "SELECT source_table FROM privreg_lineage WHERE derived_table = ?", [table]
        ).fetchone()
        return table if row is None else row[0]

    # ---- permissions ------------------------------------------------------------------------
    def get(self, table: str, con: duckdb.DuckDBPyConnection | None = None) -> TablePolicy:
        """The policy of ``table``'s source table (the default when the owner set none)."""
        if con is None:
            if not self.store.path.exists():
                return TablePolicy(table)
            with self.store.connect() as own:
                return self.get(table, own)
        source = self.source_of(table, con)
        row = con.execute(
            "SELECT allow_noiseless_release, allow_raw_export FROM privreg_policy "
            "WHERE source_table = ?",
            [source],
        ).fetchone()
        return TablePolicy(source) if row is None else TablePolicy(source, *map(bool, row))

    def set(self, table: str, **permissions: bool) -> TablePolicy:
        """The owner's decision (CLI only); refuses tables the store does not have."""
        unknown = set(permissions) - set(PERMISSIONS)
        if unknown:
            raise PolicyError(f"unknown permission(s) {sorted(unknown)}; known: {PERMISSIONS}")
        check_identifier(table, "table")
        require_own_table(self.store, table)
        with self.store.serialized(), self.store.transaction() as con:
            self.ensure_schema(con)
            source = self.source_of(table, con)
            if source != table:
                raise PolicyError(
                    f"table {table!r} is a copy of {source!r}; set the policy of {source!r}"
                )
            merged = {**self.get(table, con).as_dict(), **permissions}
            con.execute(
                "INSERT OR REPLACE INTO privreg_policy VALUES (?, ?, ?, ?)",
                [
                    table,
                    bool(merged["allow_noiseless_release"]),
                    bool(merged["allow_raw_export"]),
                    datetime.now(UTC).replace(tzinfo=None),
                ],
            )
        return self.get(table)

    def require(self, party: str, table: str, permission: str, what: str) -> None:
        """Refuse ``what`` unless the owner of ``table`` allowed ``permission``."""
        if permission not in PERMISSIONS:
            raise ValueError(f"unknown permission {permission!r}")
        policy = self.get(table)
        if not getattr(policy, permission):
            raise PolicyError(
                f"{party} refuses {what} on table {policy.table!r}: its owner's policy does not "
                f"allow it (privreg policy set --database {self.store.path} --table "
                f"{policy.table} --{permission.replace('_', '-')})"
            )


def require_own_table(store: PartyStore, table: str) -> None:
    """A budget or a policy is set only for a table the owner's store holds."""
    if not store.has_table(table):
        raise PolicyError(f"{store.path} has no table {table!r}; nothing was changed")
