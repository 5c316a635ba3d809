"""Loading a party's source file into its own store (the data owner's step)."""

from __future__ import annotations

from prefect import get_run_logger, task

from storage.descriptor import TableRef
from storage.party_store import PartyStore


@task(name="load-table", task_run_name="{ref.party}: load {ref.table}")
def load_table(source: str, ref: TableRef) -> int:
    """Validate and import ``source`` into ``ref``; replacing the table keeps re-runs idempotent."""
    rows = PartyStore.of(ref).import_file(source, ref)
    get_run_logger().info("%s: %d rows from %s into %s", ref.party, rows, source, ref.table)
    return rows
