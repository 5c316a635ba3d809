"""The privacy-budget ledger of a protected table, kept in its owner's DuckDB.

Composition is basic: the epsilons and deltas of all releases charged to a table add up.
A release from an aligned copy is charged to the copy's source table (see
:mod:`storage.policy`), so copies share one budget. Budgets are the data owner's: only
:meth:`PrivacyLedger.set_budget` (the CLI) changes one; a load may at most fill in an absent
one from the owner's own file (:meth:`PrivacyLedger.set_initial_budget`, ``tasks.loading``).
Each release is charged in the same transaction that stores it, under a release key derived
from the data and the parameters, so a retry or a re-run finds the stored release and is not
charged again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import duckdb

from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy, PolicyError, require_own_table

_TOLERANCE = 1e-12
_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS privreg_budget (
        protected_table VARCHAR PRIMARY KEY,
        epsilon_total DOUBLE NOT NULL,
        delta_total DOUBLE NOT NULL,
        updated_at TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS privreg_spend (
        release_key VARCHAR PRIMARY KEY,
        protected_table VARCHAR NOT NULL,
        epsilon DOUBLE NOT NULL,
        delta DOUBLE NOT NULL,
        mechanism VARCHAR NOT NULL,
        job_id VARCHAR NOT NULL,
        created_at TIMESTAMP NOT NULL)""",
]


class BudgetError(RuntimeError):
    """A release was refused by the ledger (no budget set, or it would be exceeded)."""


@dataclass(frozen=True)
class BudgetStatus:
    protected_table: str
    epsilon_total: float
    delta_total: float
    epsilon_spent: float
    delta_spent: float

    @property
    def epsilon_left(self) -> float:
        return max(self.epsilon_total - self.epsilon_spent, 0.0)

    @property
    def delta_left(self) -> float:
        return max(self.delta_total - self.delta_spent, 0.0)

    def as_dict(self) -> dict[str, float | str]:
        return {
            "protected_table": self.protected_table,
            "epsilon_total": self.epsilon_total,
            "epsilon_spent": self.epsilon_spent,
            "epsilon_left": self.epsilon_left,
            "delta_total": self.delta_total,
            "delta_spent": self.delta_spent,
            "delta_left": self.delta_left,
        }


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class PrivacyLedger:
    """Budgets and spends of the protected tables in one party's database."""

    def __init__(self, store: PartyStore) -> None:
        self.store = store
        self.artifacts = ArtifactStore(store)
        self.policy = OwnerPolicy(store)

    @staticmethod
    def _ensure(con: duckdb.DuckDBPyConnection) -> None:
        for statement in _SCHEMA:
            con.execute(statement)

    def _write_budget(
        self, protected_table: str, epsilon: float, delta: float, replace: bool
    ) -> bool:
        if not epsilon > 0 or not 0 <= delta < 1:
            raise ValueError("a budget needs epsilon > 0 and 0 <= delta < 1")
        require_own_table(self.store, protected_table)
        with self.store.serialized(), self.store.transaction() as con:
            self._ensure(con)
            source = self.policy.source_of(protected_table, con)
            if source != protected_table:
                raise PolicyError(
                    f"table {protected_table!r} is a copy of {source!r} and shares its budget; "
                    f"set the budget of {source!r}"
                )
            exists = con.execute(
                "SELECT count(*) FROM privreg_budget WHERE protected_table = ?", [source]
            ).fetchone()[0]
            if exists and not replace:
                return False
            con.execute(
                "INSERT OR REPLACE INTO privreg_budget VALUES (?, ?, ?, ?)",
                [source, float(epsilon), float(delta), _now()],
            )
        return True

    def set_budget(self, protected_table: str, epsilon: float, delta: float) -> None:
        """The owner's total budget for a table (replaces any earlier total, keeps spends).

        Only the data owner calls this (``privreg budget set``); no flow does.
        """
        self._write_budget(protected_table, epsilon, delta, replace=True)

    def set_initial_budget(self, protected_table: str, epsilon: float, delta: float) -> bool:
        """Set a budget only where the owner has none yet; never raises or resets one.

        Returns whether it was set. Demo job files use it at load time, so a fresh clone runs
        while a job can never top up an exhausted budget.
        """
        return self._write_budget(protected_table, epsilon, delta, replace=False)

    def budget_table(self, table: str, con: duckdb.DuckDBPyConnection | None = None) -> str:
        """The table whose budget pays for releases from ``table``: its source table."""
        return self.policy.source_of(table, con)

    def status(
        self, protected_table: str, con: duckdb.DuckDBPyConnection | None = None
    ) -> BudgetStatus:
        """The budget of ``protected_table``'s source table."""
        if con is None:
            with self.store.connect() as own:
                return self.status(protected_table, own)
        self._ensure(con)
        protected_table = self.budget_table(protected_table, con)
        budget = con.execute(
            "SELECT epsilon_total, delta_total FROM privreg_budget WHERE protected_table = ?",
            [protected_table],
        ).fetchone()
        if budget is None:
            raise BudgetError(
                f"no privacy budget is set for table {protected_table!r} in "
                f"{self.store.path.name}; its owner must set one first: privreg budget set "
                f"--database {self.store.path} --table {protected_table} --epsilon E "
                f"[--delta D] (a party service may instead name it in its party.toml, "
                f"[budgets.{protected_table}]); a job file never grants a budget"
            )
        spent = con.execute(
            "SELECT coalesce(sum(epsilon), 0), coalesce(sum(delta), 0) FROM privreg_spend "
            "WHERE protected_table = ?",
            [protected_table],
        ).fetchone()
        return BudgetStatus(protected_table, budget[0], budget[1], spent[0], spent[1])

    def budgets(self) -> list[str]:
        """The protected tables that have a budget in this database."""
        if not self.store.path.exists():
            return []
        with self.store.connect() as con:
            self._ensure(con)
            rows = con.execute("SELECT protected_table FROM privreg_budget ORDER BY 1").fetchall()
        return [row[0] for row in rows]

    def spends(self, protected_table: str | None = None) -> list[dict[str, Any]]:
        with self.store.connect() as con:
            self._ensure(con)
            query = "SELECT * FROM privreg_spend"
            params: list[Any] = []
            if protected_table is not None:
                query += " WHERE protected_table = ?"
                params.append(self.budget_table(protected_table, con))
            cursor = con.execute(query + " ORDER BY created_at", params)
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def stored_release(self, release_key: str) -> Any:
        """The release stored under ``release_key``, or ``None`` (then it must be computed)."""
        return self.artifacts.get(f"release/{release_key}")

    def require_affordable(
        self,
        protected_table: str,
        epsilon: float,
        delta: float,
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> BudgetStatus:
        """Refuse, before any computation, a release the budget cannot pay for."""
        status = self.status(protected_table, con)
        if (
            status.epsilon_spent + epsilon > status.epsilon_total + _TOLERANCE
            or status.delta_spent + delta > status.delta_total + _TOLERANCE
        ):
            source = status.protected_table
            copy = "" if source == protected_table else f" (a copy of {source!r})"
            raise BudgetError(
                f"table {protected_table!r}{copy}: a release of (epsilon={epsilon:g}, "
                f"delta={delta:g}) exceeds the budget: spent ({status.epsilon_spent:g}, "
                f"{status.delta_spent:g}) of ({status.epsilon_total:g}, {status.delta_total:g}), "
                f"left ({status.epsilon_left:g}, {status.delta_left:g})"
            )
        return status

    def charge_and_store(
        self,
        release_key: str,
        protected_table: str,
        epsilon: float,
        delta: float,
        mechanism: str,
        job_id: str,
        release: Any,
    ) -> Any:
        """Store ``release`` and charge its cost in one transaction.

        If a release is already stored under the key (a retry, or a re-run on the same data
        and parameters), nothing is charged and the stored release is returned instead.
        Charges on one database are serialised (check, then insert, under one lock), so
        concurrent releases cannot overspend; the spend is booked on the source table.
        """
        with self.store.serialized(), self.store.transaction() as con:
            self._ensure(con)
            existing = self.artifacts.get(f"release/{release_key}", con=con)
            if existing is not None:
                return existing
            status = self.require_affordable(protected_table, epsilon, delta, con)
            con.execute(
                "INSERT INTO privreg_spend VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    release_key,
                    status.protected_table,
                    float(epsilon),
                    float(delta),
                    mechanism,
                    job_id,
                    _now(),
                ],
            )
            self.artifacts.put(f"release/{release_key}", release, "release", con=con)
        return release
