"""Cardinality-only PSI, one task per party step; maths in :mod:`core.psi_count`.

The secret scalar (sealed, as in :mod:`tasks.psi`) and the values computed for the peer are
kept in the party's store for the length of the job (a retried step sends the same bytes) and
deleted with the result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core import psi, psi_count
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks.policy import PARTY_STEP
from tasks.psi import PsiSide, own_scalar, sealed_scalars, send_reblinded

KIND_BLINDED, KIND_ANSWER = "psi_count_blinded", "psi_count_answer"


def _prefix(job_id: str) -> str:
    return f"psi-count/{job_id}/"


@task(name="psi-count-lookup", task_run_name="{ref.party}: look up count", **PARTY_STEP)
def stored_count(ref: TableRef, job_id: str) -> dict[str, Any] | None:
    """The count stored by an earlier run of this job."""
    return ArtifactStore(PartyStore.of(ref)).get(_prefix(job_id) + "result")


@task(name="psi-count-blind", task_run_name="{side.ref.party}: blind own ids", **PARTY_STEP)
def blind_own_ids(side: PsiSide) -> int:
    """Step 1: blind and sort own ids, send them. Returns the own set size."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    ids = store.read_table(ref, allow_missing=True)[ref.id_column].tolist()  # ids only
    blinded = psi.prepare(ids, own_scalar(store, _prefix(job_id), create=True)).blinded
    side.endpoint.send(peer, KIND_BLINDED, blinded)
    return len(ids)


@task(name="psi-count-answer", task_run_name="{side.ref.party}: answer shuffled", **PARTY_STEP)
def answer_peer(side: PsiSide) -> None:
    """Step 2: blind the peer's values again and return them shuffled."""
    send_reblinded(side, _prefix(side.job_id), (KIND_BLINDED, KIND_ANSWER), psi_count.answer)


@task(name="psi-count", task_run_name="{side.ref.party}: count shared ids", **PARTY_STEP)
def count_shared(side: PsiSide, own_size: int, min_rows: int) -> dict[str, Any]:
    """Step 3: count, refuse a count below ``min_rows``, store the result, drop the secrets."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    own_double = side.endpoint.receive(peer, KIND_ANSWER)
    peer_double = np.asarray(artifacts.get(_prefix(job_id) + "peer_double"))
    result = psi_count.count(np.asarray(own_double), own_size, peer_double, peer)
    psi_count.check_release(result, min_rows)
    summary = {"size": result.size, "own_size": result.own_size, "peer_size": result.peer_size}
    with store.transaction() as con:
        artifacts.delete_prefix(_prefix(job_id), con=con)  # the key and peer_double
        artifacts.put(_prefix(job_id) + "result", summary, "psi-count", con=con)
    sealed_scalars(store, _prefix(job_id)).destroy()  # after the commit, as in tasks.psi
    get_run_logger().info("%s: %d ids shared with %s", ref.party, result.size, peer)
    return summary
