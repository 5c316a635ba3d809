"""Loading a party's source file into its own store (the data owner's step)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from prefect import get_run_logger, task

from core.preprocessing import PreprocessingSpec
from federation.party_config import active_config
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.owner_budgets import owner_budgets
from storage.party_store import PartyStore
from tasks.policy import PARTY_STEP


@task(name="load-table", task_run_name="{ref.party}: load {ref.table}", **PARTY_STEP)
def load_table(
    source: str,
    ref: TableRef,
    initial_budget: dict[str, float] | None = None,
    preprocessing: dict[str, Any] | None = None,
) -> int:
    """Validate and import ``source`` into ``ref``; replacing the table keeps re-runs idempotent.
    A budget is only filled in where the owner's store has none (never raised or reset), from
    :func:`_owners_budget`: in party mode never the shared job file's (docs/privacy-budget.md).
    ``preprocessing``: the job's, with this party's own ``missing_values`` and ``categorical``."""
    store = PartyStore.of(ref)
    rows = store.import_file(source, ref, PreprocessingSpec.from_dict(preprocessing))
    get_run_logger().info("%s: %d rows from %s into %s", ref.party, rows, source, ref.table)
    budget, origin = _owners_budget(ref, initial_budget)
    if budget and PrivacyLedger(store).set_initial_budget(ref.table, **budget):
        get_run_logger().info(
            "%s: initial budget %s for %s, from %s", ref.party, budget, ref.table, origin
        )
    return rows


def _owners_budget(
    ref: TableRef, job_file_budget: dict[str, float] | None
) -> tuple[dict[str, float] | None, str]:
    """The budget the table's owner grants at load time, and where it comes from."""
    config = active_config()
    if config is None or config.local:
        return job_file_budget, "the job file, the local operator's own (it owns every table)"
    if job_file_budget:
        get_run_logger().warning(
            "%s: the job file's privacy_budget for %s is not applied: a job file never grants "
            "a budget; its owner sets one with privreg budget set --database %s --table %s "
            "--epsilon ..., or [budgets.%s] in its party.toml",
            ref.party, ref.table, ref.database, ref.table, ref.table,
        )  # fmt: skip
    owned = owner_budgets().get(ref.table)
    return (owned.as_dict() if owned is not None else None), "its owner's party.toml"


@task(name="fingerprint", task_run_name="{ref.party}: fingerprint {ref.table}", **PARTY_STEP)
def fingerprint(ref: TableRef) -> str:
    """A salted digest of the party's table, so runs on unchanged inputs can be recognised; the
    salt is the party's own secret, so the digest reveals only "changed or not"."""
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    salt = artifacts.get("fingerprint-salt")
    if salt is None:
        salt = secrets.token_bytes(32)
        artifacts.put("fingerprint-salt", salt, "secret")
    digest = hashlib.sha256(salt + store.fingerprint(ref).encode() + ref.id_column.encode())
    return digest.hexdigest()
