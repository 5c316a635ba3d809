"""Loading a party's source file into its own store (the data owner's step)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from prefect import get_run_logger, task

from core.preprocessing import PreprocessingSpec
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
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

    ``initial_budget`` (a demo job file's ``privacy_budget``) applies only when the owner's
    store has no budget for the table yet: it never raises, resets or tops up a budget, which
    only the owner changes, with ``privreg budget set``. ``preprocessing`` (the job's, with
    the party's own ``missing_values`` and ``categorical``) says which values mean missing,
    which columns are one-hot encoded, and whether missing cells may be stored (imputed later).
    """
    store = PartyStore.of(ref)
    rows = store.import_file(source, ref, PreprocessingSpec.from_dict(preprocessing))
    get_run_logger().info("%s: %d rows from %s into %s", ref.party, rows, source, ref.table)
    if initial_budget and PrivacyLedger(store).set_initial_budget(ref.table, **initial_budget):
        get_run_logger().info("%s: initial budget %s for %s", ref.party, initial_budget, ref.table)
    return rows


@task(name="fingerprint", task_run_name="{ref.party}: fingerprint {ref.table}", **PARTY_STEP)
def fingerprint(ref: TableRef) -> str:
    """A salted digest of the party's table, so runs on unchanged inputs can be recognised.

    The salt is the party's own secret, so the digest reveals only "changed or not".
    """
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    salt = artifacts.get("fingerprint-salt")
    if salt is None:
        salt = secrets.token_bytes(32)
        artifacts.put("fingerprint-salt", salt, "secret")
    digest = hashlib.sha256(salt + store.fingerprint(ref).encode() + ref.id_column.encode())
    return digest.hexdigest()
