"""KKRT16 PSI alignment (``protocol="kkrt"``), one task per party step; maths in
:mod:`core.psi_ot.protocol`.

The party's 16-byte job key is the only secret kept between its steps (every random value is
derived from it, so a retried step resends the same bytes); R also keeps its OPRF outputs from
step 3 to step 5. Both are deleted in the transaction that writes the aligned table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core import psi
from core.psi_ot import protocol as kkrt
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.lineage import Lineage, record
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from storage.workspace import channel_for
from tasks.policy import PARTY_STEP
from tasks.psi import aligned_table_name


def _prefix(job_id: str) -> str:
    return f"psi/{job_id}/"


def _key(artifacts: ArtifactStore, job_id: str) -> bytes:
    key = artifacts.get(_prefix(job_id) + "key")
    if key is None:
        key = kkrt.new_party_key()
        artifacts.put(_prefix(job_id) + "key", key, "secret")
    return key


def _digests(store: PartyStore, ref: TableRef) -> np.ndarray:
    """Own ids as protocol inputs; a bad id is refused naming party, table, column and row."""
    where = f"{ref.party} ({ref.table}.{ref.id_column})"
    return kkrt.item_digests(store.read_table(ref)[ref.id_column].tolist(), where)


def _write(
    store: PartyStore, ref: TableRef, job_id: str, result: psi.Intersection, min_rows: int
) -> dict[str, Any]:
    """Refuse small results, then write the aligned table and drop the job's secrets at once."""
    psi.check_release(result, min_rows)
    artifacts = ArtifactStore(store)
    aligned = store.read_table(ref).iloc[result.rows].reset_index(drop=True)
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
        for secret in ("key", "kkrt_state"):
            artifacts.delete_prefix(_prefix(job_id) + secret, con=con)
    get_run_logger().info(
        "%s aligned %d of %d rows into %s (KKRT16)", ref.party, result.size, result.own_size, table
    )
    return summary


@task(name="psi-kkrt-hello", task_run_name="{ref.party}: base-OT setup", **PARTY_STEP)
def send_hello(ref: TableRef, peer: str, job_id: str, workspace: str | None = None) -> None:
    """Step 1 (receiver): base-OT setup and own set size."""
    store = PartyStore.of(ref)
    key = _key(ArtifactStore(store), job_id)
    size = len(store.read_table(ref)[ref.id_column])
    channel_for(job_id, workspace).endpoint(ref.party).send(
        peer, kkrt.KIND_HELLO, kkrt.hello(key, size)
    )


@task(name="psi-kkrt-reply", task_run_name="{ref.party}: base-OT choices", **PARTY_STEP)
def send_reply(ref: TableRef, peer: str, job_id: str, workspace: str | None = None) -> None:
    """Step 2 (sender): base-OT choices, code key, own set size."""
    store = PartyStore.of(ref)
    key = _key(ArtifactStore(store), job_id)
    size = len(_digests(store, ref))  # refuses bad ids before anything is sent
    endpoint = channel_for(job_id, workspace).endpoint(ref.party)
    hello = endpoint.receive(peer, kkrt.KIND_HELLO)
    endpoint.send(peer, kkrt.KIND_REPLY, kkrt.reply(key, size, hello, peer))


@task(name="psi-kkrt-matrix", task_run_name="{ref.party}: OT-extension matrix", **PARTY_STEP)
def send_matrix(ref: TableRef, peer: str, job_id: str, workspace: str | None = None) -> None:
    """Step 3 (receiver): cuckoo table, OT-extension columns; keeps its own OPRF outputs."""
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    key = _key(artifacts, job_id)
    endpoint = channel_for(job_id, workspace).endpoint(ref.party)
    reply = endpoint.receive(peer, kkrt.KIND_REPLY)
    message, state = kkrt.matrix(key, _digests(store, ref), reply, peer)
    artifacts.put(
        _prefix(job_id) + "kkrt_state",
        {"outputs": state.outputs, "choice": state.choice, "peer_size": state.peer_size},
        "psi-state",
    )
    endpoint.send(peer, kkrt.KIND_MATRIX, message)


@task(name="psi-kkrt-values", task_run_name="{ref.party}: OPRF values", **PARTY_STEP)
def send_values(ref: TableRef, peer: str, job_id: str, workspace: str | None = None) -> None:
    """Step 4 (sender): the OPRF of its items under each hash function, in a secret order."""
    store = PartyStore.of(ref)
    key = _key(ArtifactStore(store), job_id)
    endpoint = channel_for(job_id, workspace).endpoint(ref.party)
    hello = endpoint.receive(peer, kkrt.KIND_HELLO)
    matrix = endpoint.receive(peer, kkrt.KIND_MATRIX)
    endpoint.send(
        peer, kkrt.KIND_VALUES, kkrt.values(key, _digests(store, ref), hello, matrix, peer)
    )


@task(name="psi-kkrt-match", task_run_name="{ref.party}: match and store", **PARTY_STEP)
def match_and_store(
    ref: TableRef, peer: str, job_id: str, min_rows: int, workspace: str | None = None
) -> dict[str, Any]:
    """Step 5 (receiver): find the intersection, tell the sender, write the aligned table."""
    store = PartyStore.of(ref)
    saved = ArtifactStore(store).get(_prefix(job_id) + "kkrt_state")
    state = kkrt.ReceiverState(
        np.asarray(saved["outputs"]), np.asarray(saved["choice"]), int(saved["peer_size"])
    )
    endpoint = channel_for(job_id, workspace).endpoint(ref.party)
    found = kkrt.match(state, endpoint.receive(peer, kkrt.KIND_VALUES), peer)
    endpoint.send(peer, kkrt.KIND_RESULT, kkrt.result_message(found, min_rows))
    return _write(store, ref, job_id, found.result, min_rows)


@task(name="psi-kkrt-finish", task_run_name="{ref.party}: store aligned rows", **PARTY_STEP)
def finish_and_store(
    ref: TableRef, peer: str, job_id: str, min_rows: int, workspace: str | None = None
) -> dict[str, Any]:
    """Step 6 (sender): own rows at the receiver's positions, written in the same order."""
    store = PartyStore.of(ref)
    key = _key(ArtifactStore(store), job_id)
    endpoint = channel_for(job_id, workspace).endpoint(ref.party)
    size = len(store.read_table(ref)[ref.id_column])
    peer_size = int(endpoint.receive(peer, kkrt.KIND_HELLO)["size"])
    result = kkrt.sender_result(
        key, size, peer_size, endpoint.receive(peer, kkrt.KIND_RESULT), peer
    )
    return _write(store, ref, job_id, result, min_rows)


def run_party(ref: TableRef, peer: str, job_id: str, min_rows: int) -> dict[str, Any]:
    """One party's whole side, in its role's order (for ``psi_align_party``)."""
    if kkrt.is_receiver(ref.party, peer):
        send_hello(ref, peer, job_id)
        send_matrix(ref, peer, job_id)
        return match_and_store(ref, peer, job_id, min_rows)
    send_reply(ref, peer, job_id)
    send_values(ref, peer, job_id)
    return finish_and_store(ref, peer, job_id, min_rows)


def run_both(
    a: TableRef, b: TableRef, job_id: str, min_rows: int, workspace: str | None
) -> list[dict[str, Any]]:
    """Both parties in one process (for ``psi_align``); results in the order ``a, b``."""
    receiver, sender = (a, b) if kkrt.is_receiver(a.party, b.party) else (b, a)
    send_hello(receiver, sender.party, job_id, workspace)
    send_reply(sender, receiver.party, job_id, workspace)
    send_matrix(receiver, sender.party, job_id, workspace)
    send_values(sender, receiver.party, job_id, workspace)
    done = {receiver.party: match_and_store(receiver, sender.party, job_id, min_rows, workspace)}
    done[sender.party] = finish_and_store(sender, receiver.party, job_id, min_rows, workspace)
    return [done[a.party], done[b.party]]
