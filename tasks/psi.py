"""PSI alignment, one task per party step. The maths is in :mod:`core.psi`.

More (the protocol, what each party learns, why): docs/protocols/psi.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core import psi
from federation.channel import PartyEndpoint
from federation.workspace import channel_for
from storage import lineage
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.lineage import Lineage, StaleResultError, changed, record
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from storage.secrets import SealedArtifacts
from tasks.policy import PARTY_STEP


@dataclass(frozen=True)
class PsiSide:
    """One party's side of an alignment job: its own table, its peer, and its endpoint (the
    job's channel as this party, built once by its flow and handed to every step)."""

    ref: TableRef
    peer: str
    endpoint: PartyEndpoint = field(compare=False, repr=False)

    @property
    def job_id(self) -> str:
        return self.endpoint.channel.run

    @classmethod
    def of(cls, ref: TableRef, peer: str, job_id: str) -> PsiSide:
        return cls(ref, peer, channel_for(job_id).endpoint(ref.party))


def _prefix(job_id: str) -> str:
    return f"psi/{job_id}/"


def sealed_scalars(store: PartyStore, prefix: str) -> SealedArtifacts:
    """Where the party keeps its secret scalar of the job under ``prefix``, sealed
    (:mod:`storage.secrets`); destroyed once the job's result is stored."""
    return SealedArtifacts(store, prefix.rstrip("/"))


def own_scalar(store: PartyStore, prefix: str, *, create: bool = False) -> int:
    """The party's secret scalar of the job under ``prefix``: drawn once, by the step that
    blinds its own ids (``create``), so a retried step sends the same bytes; a later step
    that finds none is refused rather than blinding with a scalar of its own."""
    sealed = sealed_scalars(store, prefix)
    key = sealed.get(prefix + "key")
    if key is None and not create:
        raise psi.PsiError(f"no secret scalar under {prefix!r}: its ids were never blinded")
    if key is None:
        key = psi.new_key()
        sealed.put(prefix + "key", key)
    return key


def aligned_table_name(ref: TableRef) -> str:
    return f"{ref.table}_aligned"


@task(name="psi-lookup", task_run_name="{ref.party}: look up alignment", **PARTY_STEP)
def stored_alignment(
    ref: TableRef, job_id: str, refuse_changed: bool = True
) -> dict[str, Any] | None:
    """This job's stored alignment, if its copy exists, its source is unchanged and no other
    job rewrote the copy (:mod:`storage.lineage`); else :class:`StaleResultError` (a new run is
    needed), or with ``refuse_changed=False`` (a caller of both sides, which aligns again under a
    fresh id) ``{"changed": reason}``: the old rows never come back under this id."""
    store = PartyStore.of(ref)
    result = ArtifactStore(store).get(_prefix(job_id) + "result")
    if result is None or not store.has_table(result["table"]):
        return None
    reason = changed(store, _prefix(job_id), job_id, store.fingerprint(ref))
    if reason is not None and refuse_changed:
        raise StaleResultError(
            f"{ref.party}: {reason}, so its alignment is not reused; start a new run (a new "
            f"job id, e.g. privreg party pipeline --run <name>) to align the tables as they are"
        )
    if reason is not None:
        get_run_logger().info("%s: %s, so its alignment is not reused", ref.party, reason)
        return {"changed": reason}
    get_run_logger().info(
        "%s: reused alignment of job %s (%s unchanged)", ref.party, job_id, ref.table
    )
    return result


@task(name="psi-blind", task_run_name="{side.ref.party}: blind own ids", **PARTY_STEP)
def blind_own_ids(side: PsiSide) -> int:
    """Step 1: blind and sort own ids, send them to the peer. Returns the own set size."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    ids = store.read_table(ref, allow_missing=True)[ref.id_column].tolist()
    blinded = psi.prepare(ids, own_scalar(store, _prefix(job_id), create=True))
    artifacts.put(_prefix(job_id) + "rows", blinded.rows, "psi-state")
    side.endpoint.send(peer, "psi_blinded", blinded.blinded)
    get_run_logger().info("%s blinded %d ids", ref.party, len(ids))
    return len(ids)


@task(name="psi-reblind", task_run_name="{side.ref.party}: blind peer's ids", **PARTY_STEP)
def blind_peer_ids(side: PsiSide) -> int:
    """Step 2: blind the peer's values again, return them, keep the set for step 3."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    endpoint = side.endpoint
    peer_blinded = endpoint.receive(peer, "psi_blinded")
    doubled = psi.reblind(peer_blinded, own_scalar(store, _prefix(job_id)), peer=peer)
    artifacts.put(_prefix(job_id) + "peer_double", doubled, "psi-state")
    endpoint.send(peer, "psi_double", doubled)
    return len(doubled)


@task(name="psi-align", task_run_name="{side.ref.party}: store aligned rows", **PARTY_STEP)
def store_aligned_rows(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Step 3: intersect, refuse small results, write the aligned table in one transaction."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    own_double = side.endpoint.receive(peer, "psi_double")
    result = psi.intersect(
        np.asarray(own_double),
        np.asarray(artifacts.get(_prefix(job_id) + "rows")),
        np.asarray(artifacts.get(_prefix(job_id) + "peer_double")),
        peer=peer,
    )
    psi.check_release(result, min_rows)
    aligned = store.read_table(ref, allow_missing=True).iloc[result.rows].reset_index(drop=True)
    table = aligned_table_name(ref)
    summary = {
        "table": table,
        "size": result.size,
        "own_size": result.own_size,
        "peer_size": result.peer_size,
    }
    lineage = Lineage(ref.table, store.fingerprint(ref), table, job_id)
    with store.transaction() as con:
        store.write_table(table, aligned, con)
        OwnerPolicy(store).record_source(table, ref.table, con)  # the copy shares its budget
        artifacts.put(_prefix(job_id) + "result", summary, "psi-result", con=con)
        record(store, _prefix(job_id), lineage, con)  # what a re-run may reuse it for
        for secret in ("key", "rows", "peer_double"):
            artifacts.delete_prefix(_prefix(job_id) + secret, con=con)
    # after the commit: a failed write keeps the job resumable
    sealed_scalars(store, _prefix(job_id)).destroy()
    get_run_logger().info(
        "%s aligned %d of %d rows into %s", ref.party, result.size, result.own_size, table
    )
    return summary


def current_alignment(ref: TableRef, min_rows: int = 1) -> str | None:
    """The job whose alignment of ``ref``'s table stands: its aligned copy was last written by
    that job, from the table as it is now, with at least ``min_rows`` rows (``None``: none).
    Why: aligning the same table again would only rewrite the copy that job's later stages
    (and their resumes) use."""
    store = PartyStore.of(ref)
    job = lineage.writer(store, aligned_table_name(ref))
    if job is None:
        return None
    stored = stored_alignment.fn(ref, job, refuse_changed=False)
    if stored is None or "changed" in stored or stored["size"] < min_rows:
        return None
    return job
