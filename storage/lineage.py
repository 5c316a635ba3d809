"""What a stored result was computed from, so a re-run reuses it only while that still holds.

A stored alignment (``<table>_aligned`` plus its ``psi/<job>/result``) is reused by a re-run of
the same job. It is bound here to two facts, recorded in the same transaction that writes it:

* the content digest of the source table it was computed from (``PartyStore.fingerprint``,
  never sent anywhere: it stays in the party's own store), and
* which job wrote the output table last (another job's alignment replaces ``<table>_aligned``).

:func:`changed` says, in words, which fact no longer holds; the caller re-computes under a
fresh job id where it controls every side, or refuses where the id was agreed with a peer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import duckdb

from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore

KIND = "lineage"


class StaleResultError(ValueError):
    """A stored result was computed from a table that has changed since (bad input: a retry
    would fail alike)."""


@dataclass(frozen=True)
class Lineage:
    """A result's inputs: the source table and its digest, the output table and its writer."""

    source_table: str
    source_digest: str
    output_table: str
    job_id: str


def _key(prefix: str) -> str:
    return prefix.rstrip("/") + "/lineage"


def _writer_key(table: str) -> str:
    return f"lineage/written-by/{table}"


def record(
    store: PartyStore, prefix: str, lineage: Lineage, con: duckdb.DuckDBPyConnection
) -> None:
    """Store ``lineage`` beside the result under ``prefix`` (inside the writer's transaction)."""
    artifacts = ArtifactStore(store)
    artifacts.put(_key(prefix), asdict(lineage), KIND, con=con)
    artifacts.put(_writer_key(lineage.output_table), lineage.job_id, KIND, con=con)


def writer(store: PartyStore, table: str) -> str | None:
    """The job that last wrote ``table`` (``None``: no job recorded one)."""
    return ArtifactStore(store).get(_writer_key(table))


def changed(store: PartyStore, prefix: str, job_id: str, source_digest: str) -> str | None:
    """Why job ``job_id``'s result under ``prefix`` may not be reused (``None``: its inputs are
    unchanged). ``source_digest`` is the source table's digest now."""
    artifacts = ArtifactStore(store)
    stored = artifacts.get(_key(prefix))
    if stored is None:
        return f"job {job_id}'s stored result records no digest of the table it came from"
    lineage = Lineage(**stored)
    if lineage.source_digest != source_digest:
        return f"table {lineage.source_table!r} changed since job {job_id} used it"
    last = artifacts.get(_writer_key(lineage.output_table))
    if last != lineage.job_id:
        return f"table {lineage.output_table!r} was rewritten by job {last} after job {job_id}"
    return None
