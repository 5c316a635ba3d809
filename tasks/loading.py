"""Loading a party's source file into its own store (the data owner's step)."""

from __future__ import annotations

import hashlib
import secrets

from prefect import get_run_logger, task

from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from tasks.policy import PARTY_STEP


@task(name="load-table", task_run_name="{ref.party}: load {ref.table}", **PARTY_STEP)
def load_table(source: str, ref: TableRef) -> int:
    """Validate and import ``source`` into ``ref``; replacing the table keeps re-runs idempotent."""
    rows = PartyStore.of(ref).import_file(source, ref)
    get_run_logger().info("%s: %d rows from %s into %s", ref.party, rows, source, ref.table)
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


@task(name="privacy-budget", task_run_name="{ref.party}: budget of {table}", **PARTY_STEP)
def set_privacy_budget(ref: TableRef, table: str, epsilon: float, delta: float = 0.0) -> dict:
    """The data owner's total budget for one of its tables (earlier spends stay on the books).

    Job files carry the owner's decision as ``privacy_budget``; setting it again is idempotent.
    """
    ledger = PrivacyLedger(PartyStore.of(ref))
    ledger.set_budget(table, epsilon, delta)
    return ledger.status(table).as_dict()
