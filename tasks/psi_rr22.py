"""RR22 PSI alignment (``protocol: "rr22"``), one task per party step and table or bucket;
maths in :mod:`core.psi_ot.rr22`. The ids, digest table, buckets, job key, release and written
table are KKRT16's (:mod:`tasks.psi_kkrt`), so both protocols align the same rows in the same
way; only the per-bucket messages differ (four, not two: the VOLE takes one round trip).
More (the order they are pipelined in: :func:`party_side`): docs/protocols/psi.md."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
from prefect import task

from core.psi_ot import rr22
from core.psi_ot.buckets import Plan
from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore
from tasks.policy import PARTY_STEP
from tasks.psi import PsiSide
from tasks.psi_kkrt import (
    MatchedPositions,
    Step,
    bucket_done_key,
    bucket_rows,
    held_key,
    job_key,
    pending_bucket,
    pending_plan,
    release_matches,
    start,
    store_bucket_matches,
    store_matched_rows,
)

#: Per-process state between a party's steps of one table, keyed by (store, job, table): R's
#: VOLE side between extend and okvs, R's outputs and rows between okvs and match, S's share
#: ``B`` between vole and values. A step in another process (a resumed run) recomputes them
#: from the job key and the messages, which gives the very messages already sent.
_RECEIVER_VOLES: dict[tuple[str, str, int], rr22.ReceiverVole] = {}
_RECEIVER_STATES: dict[tuple[str, str, int], tuple[np.ndarray, rr22.ReceiverState]] = {}
_SENDER_SHARES: dict[tuple[str, str, int], np.ndarray] = {}


@task(
    name="psi-rr22-start", task_run_name="{side.ref.party}: own ids, sizes, base OTs", **PARTY_STEP
)
def start_side(side: PsiSide) -> Plan:
    """Steps 0 to 2: :func:`tasks.psi_kkrt.start` with RR22's base OTs."""
    return start(side, rr22)


def _receiver_vole(side: PsiSide, plan: Plan, table: int) -> rr22.ReceiverVole:
    key = job_key(PartyStore.of(side.ref), side.job_id)
    reply = side.endpoint.receive(side.peer, rr22.KIND_REPLY)
    message, kept = rr22.extend(key, reply, plan, table, side.peer)
    side.endpoint.send(side.peer, rr22.KIND_EXTEND, message, round=table)  # idempotent
    _RECEIVER_VOLES[held_key(side, table)] = kept
    return kept


@task(name="psi-rr22-extend", task_run_name="{side.ref.party}: extend, table {table}", **PARTY_STEP)
def send_extend(side: PsiSide, table: int) -> None:
    """Step 3 (R): the correlated-OT columns of one table's VOLE."""
    if (plan := pending_plan(side, table)) is not None:
        _receiver_vole(side, plan, table)


@task(name="psi-rr22-vole", task_run_name="{side.ref.party}: VOLE, table {table}", **PARTY_STEP)
def send_vole(side: PsiSide, table: int) -> None:
    """Step 4 (S): the VOLE message of one table; keeps its share ``B``."""
    if (plan := pending_plan(side, table)) is not None:
        _sender_share(side, plan, table)


def _sender_share(side: PsiSide, plan: Plan, table: int) -> np.ndarray:
    key, endpoint, peer = job_key(PartyStore.of(side.ref), side.job_id), side.endpoint, side.peer
    hello = endpoint.receive(peer, rr22.KIND_HELLO)
    extend = endpoint.receive(peer, rr22.KIND_EXTEND, round=table)
    made = rr22.sender_vole(key, hello, extend, plan, table, peer)
    endpoint.send(peer, rr22.KIND_VOLE, made.message, round=table)
    _SENDER_SHARES[held_key(side, table)] = made.b
    return made.b


def _receiver_state(side: PsiSide, plan: Plan, table: int) -> tuple[np.ndarray, Any]:
    store = PartyStore.of(side.ref)
    with store.session():
        key = job_key(store, side.job_id)
        rows, digests = bucket_rows(store, side.job_id, plan, None if plan.one_table else table)
    kept = _RECEIVER_VOLES.pop(held_key(side, table), None) or _receiver_vole(side, plan, table)
    message = side.endpoint.receive(side.peer, rr22.KIND_VOLE, round=table)
    okvs_message, state = rr22.encode(key, digests, kept, message, plan, table, side.peer)
    side.endpoint.send(side.peer, rr22.KIND_OKVS, okvs_message, round=table)
    _RECEIVER_STATES[held_key(side, table)] = (rows, state)
    return rows, state


@task(name="psi-rr22-okvs", task_run_name="{side.ref.party}: OKVS, table {table}", **PARTY_STEP)
def send_okvs(side: PsiSide, table: int) -> None:
    """Step 5 (R): finish the table's VOLE, send ``P + A``; keeps its outputs."""
    if (plan := pending_plan(side, table)) is not None:
        _receiver_state(side, plan, table)


@task(
    name="psi-rr22-values", task_run_name="{side.ref.party}: values, bucket {bucket}", **PARTY_STEP
)
def send_values(side: PsiSide, bucket: int) -> None:
    """Step 6 (S): ``H'`` of one bucket's items against R's table."""
    if (pending := pending_bucket(side, bucket)) is None:
        return
    plan, key, digests = pending
    table = plan.matrix_round(bucket)
    held = held_key(side, table)
    share = _SENDER_SHARES.get(held)
    if share is None:
        share = _sender_share(side, plan, table)
    okvs_message = side.endpoint.receive(side.peer, rr22.KIND_OKVS, round=table)
    message = rr22.values(key, digests, share, okvs_message, plan, bucket, side.peer)
    side.endpoint.send(side.peer, rr22.KIND_VALUES, message, round=bucket)
    done = bucket_done_key(side.job_id, bucket)
    ArtifactStore(PartyStore.of(side.ref)).put(done, {"sent": True}, "psi-state")
    if not plan.one_table:
        _SENDER_SHARES.pop(held, None)


@task(name="psi-rr22-match", task_run_name="{side.ref.party}: match, bucket {bucket}", **PARTY_STEP)
def match_bucket(side: PsiSide, bucket: int) -> None:
    """Step 7 (R): one bucket's matches, kept with the bucket's "done" mark."""
    if (plan := pending_plan(side, bucket)) is None:
        return
    table = plan.matrix_round(bucket)
    saved = _RECEIVER_STATES.get(held_key(side, table)) or _receiver_state(side, plan, table)
    rows, state = saved
    values = side.endpoint.receive(side.peer, rr22.KIND_VALUES, round=bucket)
    found = rr22.match(state, values, side.peer)
    store_bucket_matches(side, bucket, found.positions, rows[found.result.rows])
    if not plan.one_table:
        _RECEIVER_STATES.pop(held_key(side, table), None)


#: RR22's matched positions travel as a bitmap over S's padded bucket
RR22_BITMAP = MatchedPositions(
    "RR22",
    rr22.KIND_RESULT,
    rr22.KIND_MATCHED,
    lambda positions, plan: rr22.matched_message(positions, plan.peer_padded),
    rr22.sender_rows,
    rr22.forget_base_ots,
    (_RECEIVER_VOLES, _RECEIVER_STATES, _SENDER_SHARES),
)


@task(name="psi-rr22-release", task_run_name="{side.ref.party}: release and store", **PARTY_STEP)
def release_and_store(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Step 7 (R): :func:`tasks.psi_kkrt.release_matches` with a bitmap per bucket."""
    return release_matches(side, min_rows, RR22_BITMAP)


@task(name="psi-rr22-finish", task_run_name="{side.ref.party}: store aligned rows", **PARTY_STEP)
def finish_and_store(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Step 8 (S): :func:`tasks.psi_kkrt.store_matched_rows` from the bitmaps."""
    return store_matched_rows(side, min_rows, RR22_BITMAP)


# ---- whole sides -----------------------------------------------------------------------------


def party_side(side: PsiSide, min_rows: int, call: Step = operator.call) -> dict[str, Any]:
    """One party's whole side in its role's order (``call`` as in
    :func:`tasks.psi_kkrt.party_side`), the database open throughout. Pipelined: R sends
    ``extend`` two tables and ``okvs`` one table ahead of its match, S ``vole`` of table k + 1
    before its values of bucket k, so each party computes while the other does."""
    with PartyStore.of(side.ref).session():
        plan = call(start_side, side)
        tables = 1 if plan.one_table else plan.buckets
        if plan.receiver:  # R runs ahead: okvs k + 1 while S computes values k
            for table in range(min(2, tables)):
                call(send_extend, side, table)
            call(send_okvs, side, 0)
            for bucket in range(plan.buckets):
                if bucket + 2 < tables:
                    call(send_extend, side, bucket + 2)
                if bucket + 1 < tables:
                    call(send_okvs, side, bucket + 1)
                call(match_bucket, side, bucket)
            return call(release_and_store, side, min_rows)
        call(send_vole, side, 0)
        for bucket in range(plan.buckets):
            if bucket + 1 < tables:
                call(send_vole, side, bucket + 1)
            call(send_values, side, bucket)
        return call(finish_and_store, side, min_rows)
