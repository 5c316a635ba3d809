"""PSI alignment, one task per party step. The maths is in :mod:`core.psi`.

More (the protocol, what each party learns, why): docs/protocols/psi.md.
"""

from __future__ import annotations

from collections.abc import Callable
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


def job_prefix(job_id: str) -> str:
    """Where the job's state, result and lineage are kept (KKRT16's and RR22's too)."""
    return f"psi/{job_id}/"


def sealed_scalars(store: PartyStore, prefix: str) -> SealedArtifacts:
    """Where the party keeps its secret scalar of the job under ``prefix``, sealed
    (:mod:`storage.secrets`); destroyed once the job's result is stored."""
    return SealedArtifacts(store, prefix.rstrip("/"))


def own_scalar(
    store: PartyStore, prefix: str, *, create: bool = False, new: Callable[[], Any] = psi.new_key
) -> Any:
    """The party's secret scalar (or ``new``'s key) of the job under ``prefix``: drawn once, by
    the step that blinds its own ids (``create``), so a retried step sends the same bytes; a
    later step that finds none is refused rather than blinding with a scalar of its own."""
    sealed = sealed_scalars(store, prefix)
    key = sealed.get(prefix + "key")
    if key is None and not create:
        raise psi.PsiError(f"no secret scalar under {prefix!r}: its ids were never blinded")
    if key is None:
        key = new()
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
    result = ArtifactStore(store).get(job_prefix(job_id) + "result")
    if result is None or not store.has_table(result["table"]):
        return None
    reason = changed(store, job_prefix(job_id), job_id, store.fingerprint(ref))
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
    blinded = psi.prepare(ids, own_scalar(store, job_prefix(job_id), create=True))
    artifacts.put(job_prefix(job_id) + "rows", blinded.rows, "psi-state")
    side.endpoint.send(peer, "psi_blinded", blinded.blinded)
    get_run_logger().info("%s blinded %d ids", ref.party, len(ids))
    return len(ids)


@task(name="psi-reblind", task_run_name="{side.ref.party}: blind peer's ids", **PARTY_STEP)
def blind_peer_ids(side: PsiSide) -> int:
    """Step 2: blind the peer's values again, return them, keep the set for step 3."""
    prefix = job_prefix(side.job_id)
    return len(send_reblinded(side, prefix, ("psi_blinded", "psi_double"), psi.reblind))


def send_reblinded(
    side: PsiSide, prefix: str, kinds: tuple[str, str], blind: Callable[..., Any]
) -> np.ndarray:
    """Step 2 here and in :mod:`tasks.psi_count`: the peer's ``kinds[0]`` values blinded again
    (``blind``), kept under ``prefix`` (a retry sends the same bytes), sent back as ``kinds[1]``.
    Without a stored scalar it is refused before waiting for the peer."""
    store = PartyStore.of(side.ref)
    key = own_scalar(store, prefix)
    answer = blind(side.endpoint.receive(side.peer, kinds[0]), key, peer=side.peer)
    ArtifactStore(store).put(prefix + "peer_double", answer, "psi-state")
    side.endpoint.send(side.peer, kinds[1], answer)
    return answer


@task(name="psi-align", task_run_name="{side.ref.party}: store aligned rows", **PARTY_STEP)
def store_aligned_rows(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Step 3: intersect, refuse small results, write the aligned table in one transaction."""
    ref, peer, job_id, prefix = side.ref, side.peer, side.job_id, job_prefix(side.job_id)
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    own_double = side.endpoint.receive(peer, "psi_double")
    own_rows, peer_double = (np.asarray(artifacts.get(prefix + k)) for k in ("rows", "peer_double"))
    result = psi.intersect(np.asarray(own_double), own_rows, peer_double, peer=peer)
    psi.check_release(result, min_rows)
    aligned = store.read_table(ref, allow_missing=True).iloc[result.rows].reset_index(drop=True)
    table = aligned_table_name(ref)
    sizes = {"size": result.size, "own_size": result.own_size, "peer_size": result.peer_size}
    summary = {"table": table, **sizes}
    lineage = Lineage(ref.table, store.fingerprint(ref), table, job_id)
    with store.transaction() as con:
        store.write_table(table, aligned, con)
        OwnerPolicy(store).record_source(table, ref.table, con)  # the copy shares its budget
        artifacts.delete_prefix(prefix, con=con)  # the key, rows and peer_double
        artifacts.put(prefix + "result", summary, "psi-result", con=con)
        record(store, prefix, lineage, con)  # what a re-run may reuse it for
    # after the commit: a failed write keeps the job resumable
    sealed_scalars(store, prefix).destroy()
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
