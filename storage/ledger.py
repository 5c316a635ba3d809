"""The privacy-budget ledger of a protected table, kept in its owner's DuckDB.

Each release is booked with its privacy *event* (:mod:`core.dp.accounting`: Gaussian,
discrete Gaussian, Laplace, randomized response, pure or approximate DP; a JSON dict in the
spend's ``event`` column) beside the (epsilon, delta) it was calibrated for. A table's spend is
the composition of all its events, read as epsilon at the owner's delta (the budget's
``delta_total``, a target that is not used up): dp-accounting's PLD composition, or the basic
sum of the calibrated pairs where that is smaller. A check or a charge refuses a release when
the composition with it would exceed the owner's epsilon, and refuses it too when an event
cannot be accounted (fail closed). A ledger from before events were booked is migrated when
opened: each old spend becomes the approximate-DP event of its own (epsilon, delta).

A release from an aligned copy is charged to the copy's source table (see
:mod:`storage.policy`), so copies share one budget. Budgets are the data owner's: only
:meth:`PrivacyLedger.set_budget` (the CLI) changes one; a load may at most fill in an absent
one from the owner's own file (:meth:`PrivacyLedger.set_initial_budget`, ``tasks.loading``).
Each release is charged in the same transaction that stores it, under a release key derived
from the data and the parameters, so a retry or a re-run finds the stored release and is not
charged again.

Besides the total, a table may have *window rules*: the most all releases (and, optionally,
the most one consumer: the peer or job that receives a release) may spend in a window that
refreshes (a UTC day by default). Windows keep basic sums of the calibrated epsilons, not the
composition: a window is a rate limit read per release and per consumer, a sum gives each
consumer its own share (a composed figure has none), and over one day's few releases
composing would gain little. They are rows of the owner's ledger, read and enforced in the
charge's own serialised transaction, so overlapping runs cannot both pass a check and both
charge. The owner sets one with ``privreg budget window``; a party service's ``[policy]
max_epsilon_per_day`` (its party.toml) is written into the ledger as the rule ``set_by =
'policy'`` by each check and charge made while the process runs as that party (and removed when
the policy no longer has it). A ledger that cannot be read refuses the release (fail closed).

What ``privreg budget show`` prints (the composed spend, each job's runs left) is stored with
each charge, in its transaction, with a fingerprint of the spends and the budget it was computed
from (``privreg_figures``): composing and the runs-left search need dp-accounting and take
seconds, and a command that only reads should answer at once. A figure whose fingerprint no
longer matches (a ledger from before figures were stored, a changed budget) is computed again
when shown. Checks and charges never read stored figures: they always compose.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import duckdb

from core.dp.accounting import (
    DISCRETISATION,
    MAX_RUNS,
    AccountingError,
    ApproximateDP,
    Charge,
    Event,
    composed_epsilon,
    event_from_dict,
    runs_left,
)
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
        created_at TIMESTAMP NOT NULL,
        consumer VARCHAR,
        event VARCHAR)""",
    """CREATE TABLE IF NOT EXISTS privreg_window (
        protected_table VARCHAR NOT NULL,
        set_by VARCHAR NOT NULL,
        epsilon DOUBLE,
        epsilon_per_consumer DOUBLE,
        seconds DOUBLE NOT NULL,
        updated_at TIMESTAMP NOT NULL,
        PRIMARY KEY (protected_table, set_by))""",
    """CREATE TABLE IF NOT EXISTS privreg_figures (
        protected_table VARCHAR PRIMARY KEY,
        fingerprint VARCHAR NOT NULL,
        epsilon_spent DOUBLE NOT NULL,
        runs_left VARCHAR NOT NULL)""",
]
DAY = 86400.0


class BudgetError(RuntimeError):
    """A release was refused by the ledger (no budget set, it would be exceeded, or the ledger
    could not be read)."""


@dataclass(frozen=True)
class BudgetStatus:
    """A table's budget and its composed spend: ``epsilon_spent`` is the epsilon of all its
    releases composed, at the owner's delta ``delta_total`` (which is a target, not used up)."""

    protected_table: str
    epsilon_total: float
    delta_total: float
    epsilon_spent: float

    @property
    def epsilon_left(self) -> float:
        return max(self.epsilon_total - self.epsilon_spent, 0.0)

    def as_dict(self) -> dict[str, float | str]:
        return {
            "protected_table": self.protected_table,
            "epsilon_total": self.epsilon_total,
            "epsilon_spent": self.epsilon_spent,
            "epsilon_left": self.epsilon_left,
            "delta_total": self.delta_total,
        }


def event_json(event: Event) -> str:
    """An event as the ledger stores it (sorted keys: one event, one string)."""
    return json.dumps(event.as_dict(), sort_keys=True)


_SpendRow = tuple[str, str, str | None, float, float, datetime]
"""release_key, job_id, event, epsilon, delta, created_at: what a table's figures depend on."""


def _fingerprint(budget: tuple[float, float], rows: list[_SpendRow]) -> str:
    """What stored figures were computed from: the budget, every spend row (oldest first) and
    the accountant's settings; a change to any of them makes the figures stale."""
    text = json.dumps([DISCRETISATION, MAX_RUNS, budget, rows], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _charge(event: str | None, epsilon: float, delta: float) -> Charge:
    """A spend row as the accountant reads it; a row without an event is the approximate-DP
    event of its (epsilon, delta)."""
    parsed = ApproximateDP(epsilon, delta) if event is None else event_from_dict(json.loads(event))
    return Charge(parsed, float(epsilon), float(delta))


@dataclass(frozen=True)
class WindowRule:
    """The most a table's releases may spend per window: all consumers together
    (``epsilon``) and each consumer (``epsilon_per_consumer``); either may be unset."""

    epsilon: float | None
    epsilon_per_consumer: float | None = None
    seconds: float = DAY

    def __post_init__(self) -> None:
        if self.epsilon is None and self.epsilon_per_consumer is None:
            raise ValueError("a window rule needs an epsilon, a per-consumer epsilon or both")
        for value in (self.epsilon, self.epsilon_per_consumer):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError("a window's epsilon must be a number > 0")
        if not (math.isfinite(self.seconds) and self.seconds >= 60):
            raise ValueError("a window lasts at least 60 seconds")

    def bounds(self, now: datetime) -> tuple[datetime, datetime]:
        """The window ``now`` falls in: whole windows counted from the Unix epoch (UTC), so a
        day's window is the UTC calendar day and every party reads the same bounds."""
        epoch = datetime(1970, 1, 1)
        start = math.floor((now - epoch).total_seconds() / self.seconds) * self.seconds
        begin = epoch + timedelta(seconds=start)
        return begin, begin + timedelta(seconds=self.seconds)


@dataclass(frozen=True)
class WindowStatus:
    """One rule's current window: what it allows, what was spent, when it refreshes."""

    protected_table: str
    set_by: str
    rule: WindowRule
    start: datetime
    refreshes_at: datetime
    epsilon_spent: float
    by_consumer: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "protected_table": self.protected_table,
            "set_by": self.set_by,
            "window_hours": self.rule.seconds / 3600,
            "epsilon_per_window": self.rule.epsilon,
            "epsilon_per_consumer": self.rule.epsilon_per_consumer,
            "epsilon_spent": self.epsilon_spent,
            "window_start": self.start.isoformat(sep=" ") + " UTC",
            "refreshes_at": self.refreshes_at.isoformat(sep=" ") + " UTC",
            "by_consumer": dict(self.by_consumer),
        }

    def refusal(self, epsilon: float, consumer: str | None) -> str | None:
        """Why a release of ``epsilon`` to ``consumer`` breaks this window, or None."""
        rule, where = self.rule, f"rule set by the {self.set_by}"
        if rule.epsilon is not None and self.epsilon_spent + epsilon > rule.epsilon + _TOLERANCE:
            return (
                f"epsilon {epsilon:g} after {self.epsilon_spent:g} spent in the window since "
                f"{self.start:%Y-%m-%d %H:%M} UTC exceeds its {rule.epsilon:g} per "
                f"{_hours(rule.seconds)} ({where}); the window refreshes at "
                f"{self.refreshes_at:%Y-%m-%d %H:%M} UTC"
            )
        cap, spent = rule.epsilon_per_consumer, self.by_consumer.get(consumer or "", 0.0)
        if consumer is not None and cap is not None and spent + epsilon > cap + _TOLERANCE:
            return (
                f"epsilon {epsilon:g} to {consumer} after {spent:g} spent for it in the window "
                f"since {self.start:%Y-%m-%d %H:%M} UTC exceeds its {cap:g} per consumer per "
                f"{_hours(rule.seconds)} ({where}); the window refreshes at "
                f"{self.refreshes_at:%Y-%m-%d %H:%M} UTC"
            )
        return None


def _hours(seconds: float) -> str:
    return "day" if seconds == DAY else f"{seconds / 3600:g} h"


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _policy_rule() -> WindowRule | bool | None:
    """The window rule of the party this code runs as (its party.toml's ``[policy]``); None
    when that policy sets none; False when no standing policy applies (a local run, a helper
    without a party)."""
    from federation.party_config import active_config  # a party's configuration, not a ledger's

    config = active_config()
    if config is None or config.local:
        return False
    return config.policy.window_rule()


class PrivacyLedger:
    """Budgets and spends of the protected tables in one party's database.

    ``clock`` (naive UTC) dates spends and places windows; ``lock_timeout`` is how long a
    check or charge waits for another process's hold on the database before it refuses."""

    def __init__(
        self,
        store: PartyStore,
        clock: Callable[[], datetime] = _now,
        lock_timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.artifacts = ArtifactStore(store)
        self.policy = OwnerPolicy(store)
        self.clock, self.lock_timeout = clock, lock_timeout

    @staticmethod
    def _ensure(con: duckdb.DuckDBPyConnection) -> None:
        for statement in _SCHEMA:
            con.execute(statement)
        columns = con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ?",
            ["privreg_spend"],
        ).fetchall()
        if ("consumer",) not in columns:  # a ledger from before consumers were booked
            con.execute("ALTER TABLE privreg_spend ADD COLUMN consumer VARCHAR")
        if ("event",) not in columns:  # a ledger from before events were booked
            con.execute("ALTER TABLE privreg_spend ADD COLUMN event VARCHAR")
        for key, epsilon, delta in con.execute(
            "SELECT release_key, epsilon, delta FROM privreg_spend WHERE event IS NULL"
        ).fetchall():
            old = {"mechanism": ApproximateDP.mechanism, "epsilon": epsilon, "delta": delta}
            con.execute(  # unchecked here: a row the accountant refuses refuses releases later
                "UPDATE privreg_spend SET event = ? WHERE release_key = ?",
                [json.dumps(old, sort_keys=True), key],
            )

    @contextmanager
    def _transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The serialised transaction of a check or charge. A ledger that cannot be opened or
        read (held locked past ``lock_timeout``, damaged) refuses: nothing counts as unspent."""
        with self.store.serialized():
            try:
                with self.store.transaction(self.lock_timeout) as con:
                    yield con
            except duckdb.Error as error:
                raise BudgetError(
                    f"the privacy ledger in {self.store.path.name} cannot be read ({error}); "
                    "the release is refused"
                ) from error

    def _write_budget(
        self, protected_table: str, epsilon: float, delta: float, replace: bool
    ) -> bool:
        if not epsilon > 0 or not 0 <= delta < 1:
            raise ValueError("a budget needs epsilon > 0 and 0 <= delta < 1")
        require_own_table(self.store, protected_table)
        with self.store.serialized(), self.store.transaction() as con:
            self._ensure(con)
            source = self._own_source(protected_table, con)
            exists = con.execute(
                "SELECT count(*) FROM privreg_budget WHERE protected_table = ?", [source]
            ).fetchone()[0]
            if exists and not replace:
                return False
            con.execute(
                "INSERT OR REPLACE INTO privreg_budget VALUES (?, ?, ?, ?)",
                [source, float(epsilon), float(delta), self.clock()],
            )
            self._store_figures(source, con)
        return True

    def _own_source(self, protected_table: str, con: duckdb.DuckDBPyConnection) -> str:
        """``protected_table`` itself; a copy is refused (its source's rules are its rules)."""
        source = self.policy.source_of(protected_table, con)
        if source != protected_table:
            raise PolicyError(
                f"table {protected_table!r} is a copy of {source!r} and shares its budget; "
                f"set the budget of {source!r}"
            )
        return source

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

    def set_window(self, protected_table: str, rule: WindowRule | None) -> None:
        """The owner's window rule for a table (``privreg budget window``); None removes it.
        A party's policy rule is separate (both apply)."""
        require_own_table(self.store, protected_table)
        with self._transaction() as con:
            self._ensure(con)
            self._store_rule(self._own_source(protected_table, con), "owner", rule, con)

    def _store_rule(
        self, table: str, set_by: str, rule: WindowRule | None, con: duckdb.DuckDBPyConnection
    ) -> None:
        con.execute(
            "DELETE FROM privreg_window WHERE protected_table = ? AND set_by = ?", [table, set_by]
        )
        if rule is not None:
            con.execute(
                "INSERT INTO privreg_window VALUES (?, ?, ?, ?, ?, ?)",
                [table, set_by, rule.epsilon, rule.epsilon_per_consumer, rule.seconds,
                 self.clock()],
            )  # fmt: skip

    def _refresh_policy_rule(self, table: str, con: duckdb.DuckDBPyConnection) -> None:
        """Write the running party's policy rule for ``table`` into this transaction."""
        rule = _policy_rule()
        if rule is not False:
            self._store_rule(table, "policy", rule or None, con)

    def windows(
        self, protected_table: str, con: duckdb.DuckDBPyConnection | None = None
    ) -> list[WindowStatus]:
        """Every window rule of ``protected_table``'s source table, with its current spend."""
        if con is None:
            with self._transaction() as own:
                return self.windows(protected_table, own)
        self._ensure(con)
        table = self.budget_table(protected_table, con)
        rows = con.execute(
            "SELECT set_by, epsilon, epsilon_per_consumer, seconds FROM privreg_window "
            "WHERE protected_table = ? ORDER BY set_by",
            [table],
        ).fetchall()
        now = self.clock()
        found = []
        for set_by, epsilon, per_consumer, seconds in rows:
            rule = WindowRule(epsilon, per_consumer, seconds)
            start, end = rule.bounds(now)
            spent = dict(
                con.execute(
                    "SELECT coalesce(consumer, job_id), sum(epsilon) FROM privreg_spend "
                    "WHERE protected_table = ? AND created_at >= ? AND created_at < ? "
                    "GROUP BY 1 ORDER BY 1",
                    [table, start, end],
                ).fetchall()
            )
            total = float(sum(spent.values(), 0.0))
            found.append(WindowStatus(table, set_by, rule, start, end, total, spent))
        return found

    def budget_table(self, table: str, con: duckdb.DuckDBPyConnection | None = None) -> str:
        """The table whose budget pays for releases from ``table``: its source table."""
        return self.policy.source_of(table, con)

    def status(
        self, protected_table: str, con: duckdb.DuckDBPyConnection | None = None
    ) -> BudgetStatus:
        """The budget of ``protected_table``'s source table."""
        if con is None:
            with self._transaction() as own:
                return self.status(protected_table, own)
        self._ensure(con)
        protected_table = self.budget_table(protected_table, con)
        budget = self._budget(protected_table, con)
        charges = self._charges(protected_table, con)
        spent = self._composed(protected_table, charges, budget[1])
        return BudgetStatus(protected_table, budget[0], budget[1], spent)

    def _budget(self, protected_table: str, con: duckdb.DuckDBPyConnection) -> tuple[float, float]:
        """The owner's (epsilon_total, delta_total) of a source table; refuses without one."""
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
        return float(budget[0]), float(budget[1])

    def charges(self, protected_table: str) -> list[Charge]:
        """Every spend of ``protected_table``'s source table as the accountant reads it."""
        with self._transaction() as con:
            self._ensure(con)
            return self._charges(self.budget_table(protected_table, con), con)

    def _charges(self, table: str, con: duckdb.DuckDBPyConnection) -> list[Charge]:
        """Every spend of ``table`` (a source table) as the accountant reads it."""
        return self._read_charges(table, self._spend_rows(table, con))

    def _read_charges(self, table: str, rows: list[_SpendRow]) -> list[Charge]:
        """``rows`` (a table's spend rows) as the accountant reads them."""
        try:
            return [_charge(event, epsilon, delta) for _, _, event, epsilon, delta, _ in rows]
        except (AccountingError, ValueError) as error:
            raise BudgetError(
                f"a spend of table {table!r} in {self.store.path.name} holds an event that "
                f"cannot be accounted ({error}); releases are refused"
            ) from error

    @staticmethod
    def _spend_rows(table: str, con: duckdb.DuckDBPyConnection) -> list[_SpendRow]:
        """Every spend row of ``table`` (a source table), oldest first."""
        return con.execute(
            "SELECT release_key, job_id, event, epsilon, delta, created_at FROM privreg_spend "
            "WHERE protected_table = ? ORDER BY created_at, release_key",
            [table],
        ).fetchall()

    def _composed(self, table: str, charges: list[Charge], delta: float) -> float:
        """The composed epsilon of ``charges`` at ``delta``; refuses (fail closed) when the
        accountant cannot compute it."""
        try:
            return composed_epsilon(charges, delta)
        except AccountingError as error:
            raise BudgetError(
                f"the spends of table {table!r} cannot be composed ({error}); releases are refused"
            ) from error

    def plan(self, protected_table: str) -> list[dict[str, Any]]:
        """For each job that spent from the table (latest first): its latest event and how
        many more releases of it fit in the budget, by the test a charge applies."""
        with self._transaction() as con:
            self._ensure(con)
            table = self.budget_table(protected_table, con)
            budget, rows = self._budget(table, con), self._spend_rows(table, con)
        _, runs = self._figures(table, budget, rows)
        return self._plans(table, rows, runs)

    def report(self, protected_table: str) -> tuple[BudgetStatus, list[dict[str, Any]]]:
        """:meth:`status` and :meth:`plan` as ``privreg budget show`` prints them: from the
        figures stored with the table's last charge while their fingerprint matches, else
        computed (by the same accountant) and stored for the next time."""
        with self._transaction() as con:
            self._ensure(con)
            table = self.budget_table(protected_table, con)
            budget, rows = self._budget(table, con), self._spend_rows(table, con)
            stored = self._stored_figures(table, budget, rows, con)
            if stored is None:
                stored = self._figures(table, budget, rows)
                self._write_figures(table, _fingerprint(budget, rows), *stored, con)
        spent, runs = stored
        status = BudgetStatus(table, budget[0], budget[1], spent)
        return status, self._plans(table, rows, runs)

    @staticmethod
    def _stored_figures(
        table: str,
        budget: tuple[float, float],
        rows: list[_SpendRow],
        con: duckdb.DuckDBPyConnection,
    ) -> tuple[float, dict[str, int]] | None:
        """The figures stored for ``table`` if they were computed from ``budget`` and ``rows``."""
        stored = con.execute(
            "SELECT epsilon_spent, runs_left FROM privreg_figures "
            "WHERE protected_table = ? AND fingerprint = ?",
            [table, _fingerprint(budget, rows)],
        ).fetchone()
        return None if stored is None else (float(stored[0]), json.loads(stored[1]))

    def _figures(
        self,
        table: str,
        budget: tuple[float, float],
        rows: list[_SpendRow],
        known: dict[Charge, int] | None = None,
    ) -> tuple[float, dict[str, int]]:
        """The composed spend of ``rows`` at the owner's delta, and per job the runs of its
        latest release that still fit (the test a charge applies; ``known``: runs left of some
        releases, already counted)."""
        epsilon_total, delta_total = budget
        charges = self._read_charges(table, rows)
        left, runs = dict(known or {}), {}
        for job_id, (_, run) in self._latest(table, rows).items():
            if run not in left:  # jobs repeating one release share its count
                try:
                    left[run] = runs_left(charges, run, epsilon_total, delta_total)
                except AccountingError as error:
                    raise BudgetError(f"table {table!r}: {error}") from error
            runs[job_id] = left[run]
        return self._composed(table, charges, delta_total), runs

    def _one_run_fewer(
        self, table: str, run: Charge, con: duckdb.DuckDBPyConnection
    ) -> dict[Charge, int]:
        """Runs left of ``run`` once one more is charged: one fewer than the stored figures
        say now, because that test is the same composition one run further along. Empty
        when the stored figures are stale, do not count ``run`` or reached MAX_RUNS (then
        the search counts it)."""
        budget, rows = self._budget(table, con), self._spend_rows(table, con)
        stored = self._stored_figures(table, budget, rows, con)
        if stored is None:
            return {}
        for job_id, (_, latest) in self._latest(table, rows).items():
            left = stored[1].get(job_id, 0)
            if latest == run and 1 <= left < MAX_RUNS:
                return {run: left - 1}
        return {}

    def _latest(self, table: str, rows: list[_SpendRow]) -> dict[str, tuple[datetime, Charge]]:
        """Each job's latest spend (when, and as the accountant reads it), latest job first."""
        latest: dict[str, tuple[datetime, Charge]] = {}
        for row in reversed(rows):
            if row[1] not in latest:
                latest[row[1]] = (row[5], self._read_charges(table, [row])[0])
        return latest

    def _plans(
        self, table: str, rows: list[_SpendRow], runs: dict[str, int]
    ) -> list[dict[str, Any]]:
        """:meth:`plan`'s rows from the spend rows and each job's runs left."""
        return [
            {
                "job_id": job_id,
                "last_run": created_at,
                "event": run.event.as_dict(),
                "mechanism": run.event.describe(),
                "epsilon": run.epsilon,
                "delta": run.delta,
                "runs_left": runs[job_id],
            }
            for job_id, (created_at, run) in self._latest(table, rows).items()
        ]

    def _store_figures(
        self, table: str, con: duckdb.DuckDBPyConnection, known: dict[Charge, int] | None = None
    ) -> None:
        """Compute and store ``table``'s figures in this transaction; where they cannot be
        computed, leave none (showing them then refuses, as checks and charges do)."""
        budget, rows = self._budget(table, con), self._spend_rows(table, con)
        try:
            spent, runs = self._figures(table, budget, rows, known)
        except BudgetError:
            con.execute("DELETE FROM privreg_figures WHERE protected_table = ?", [table])
            return
        self._write_figures(table, _fingerprint(budget, rows), spent, runs, con)

    @staticmethod
    def _write_figures(
        table: str,
        fingerprint: str,
        spent: float,
        runs: dict[str, int],
        con: duckdb.DuckDBPyConnection,
    ) -> None:
        con.execute(
            "INSERT OR REPLACE INTO privreg_figures VALUES (?, ?, ?, ?)",
            [table, fingerprint, spent, json.dumps(runs, sort_keys=True)],
        )

    def budgets(self) -> list[str]:
        """The protected tables that have a budget in this database."""
        if not self.store.path.exists():
            return []
        with self.store.connect() as con:
            self._ensure(con)
            rows = con.execute("SELECT protected_table FROM privreg_budget ORDER BY 1").fetchall()
        return [row[0] for row in rows]

    def spends(self, protected_table: str | None = None) -> list[dict[str, Any]]:
        """Every spend row (oldest first), its event as stored (a JSON string)."""
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
        consumer: str | None = None,
        event: Event | None = None,
    ) -> BudgetStatus:
        """Refuse, before any computation, a release the budget or a window cannot pay for
        (a window's per-consumer cap only when ``consumer`` is named).

        ``event`` is the release's privacy event; without one it is the approximate-DP event
        of (``epsilon``, ``delta``). The budget test composes it with every earlier spend."""
        if con is None:
            with self._transaction() as own:
                return self.require_affordable(
                    protected_table, epsilon, delta, own, consumer, event
                )
        status = self.status(protected_table, con)
        source = status.protected_table
        copy = "" if source == protected_table else f" (a copy of {source!r})"
        try:
            charge = Charge(event or ApproximateDP(epsilon, delta), float(epsilon), float(delta))
        except AccountingError as error:
            raise BudgetError(f"table {protected_table!r}{copy}: {error}") from error
        after = self._composed(source, [*self._charges(source, con), charge], status.delta_total)
        if after > status.epsilon_total + _TOLERANCE:
            raise BudgetError(
                f"table {protected_table!r}{copy}: a release of {charge.event.describe()} "
                f"(calibrated for epsilon={epsilon:g}, delta={delta:g}) exceeds the budget: "
                f"composed with the earlier releases it makes epsilon {after:.6g} at the "
                f"owner's delta {status.delta_total:g}, over the total {status.epsilon_total:g} "
                f"(spent {status.epsilon_spent:.6g}, left {status.epsilon_left:.6g})"
            )
        self._refresh_policy_rule(source, con)
        for window in self.windows(source, con):
            if (why := window.refusal(epsilon, consumer)) is not None:
                raise BudgetError(f"table {protected_table!r}{copy}: a release of {why}")
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
        consumer: str | None = None,
        event: Event | None = None,
    ) -> Any:
        """Store ``release`` and charge its cost in one transaction.

        ``event`` is the release's privacy event (default: the approximate-DP event of
        ``epsilon`` and ``delta``), booked with it and composed into the table's spend.
        If a release is already stored under the key (a retry, or a re-run on the same data
        and parameters), nothing is charged and the stored release is returned instead.
        Charges on one database are serialised (check, then insert, under one lock), so
        concurrent releases cannot overspend the total or a window; the spend is booked on
        the source table, for ``consumer`` (the peer receiving the release; default: the job).
        """
        consumer = consumer or job_id
        with self._transaction() as con:
            self._ensure(con)
            existing = self.artifacts.get(f"release/{release_key}", con=con)
            if existing is not None:
                return existing
            event = event or ApproximateDP(epsilon, delta)
            status = self.require_affordable(protected_table, epsilon, delta, con, consumer, event)
            booked = _charge(event_json(event), epsilon, delta)  # as the row will read back
            known = self._one_run_fewer(status.protected_table, booked, con)
            con.execute(
                "INSERT INTO privreg_spend (release_key, protected_table, epsilon, delta, "
                "mechanism, job_id, created_at, consumer, event) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [release_key, status.protected_table, float(epsilon), float(delta), mechanism,
                 job_id, self.clock(), consumer, event_json(event)],
            )  # fmt: skip
            self.artifacts.put(f"release/{release_key}", release, "release", con=con)
            self._store_figures(status.protected_table, con, known)
        return release
