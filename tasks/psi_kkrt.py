"""KKRT16 PSI alignment (``protocol: "kkrt"``), one task per party step and bucket; maths in
:mod:`core.psi_ot.protocol`. Its ids, digest tables, buckets, job key and written table are
RR22's too (:mod:`tasks.psi_rr22` imports those helpers by their public names).
More (the protocol, what each party learns, why): docs/protocols/psi.md.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pandas as pd
from prefect import get_run_logger, task

from core import psi
from core.psi_ot import buckets
from core.psi_ot import protocol as kkrt
from core.psi_ot.buckets import Plan
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.lineage import Lineage, record
from storage.party_store import Fingerprint, PartyStore, table_chunks
from storage.policy import OwnerPolicy
from tasks.policy import PARTY_STEP
from tasks.psi import PsiSide, aligned_table_name, job_prefix, own_scalar, sealed_scalars


def working_tables(job_id: str) -> tuple[str, str]:
    """This job's digest and match tables in the party's store."""
    tag = hashlib.sha256(job_id.encode()).hexdigest()[:16]
    return f"privreg_psi_ids_{tag}", f"privreg_psi_matches_{tag}"


#: The job keys this process has read, so each bucket's step does not unseal it again; dropped
#: when the job's secrets are destroyed.
JOB_KEYS: dict[tuple[str, str], bytes] = {}


def job_key(store: PartyStore, job_id: str) -> bytes:
    """The party's sealed key of the job (:func:`tasks.psi.own_scalar`), drawn on first use."""
    if (key := JOB_KEYS.get(held := (str(store.path), job_id))) is None:
        key = own_scalar(store, job_prefix(job_id), create=True, new=kkrt.new_party_key)
        JOB_KEYS[held] = key
    return key


def _where(ref: TableRef) -> str:
    return f"{ref.party} ({ref.table}.{ref.id_column})"


# ---- step 0: own ids into the digest table, sizes --------------------------------------------


def insert_frame(con: duckdb.DuckDBPyConnection, table: str, frame: pd.DataFrame) -> None:
    con.register("_privreg_psi_rows", frame)
    try:
        con.execute(f'INSERT INTO "{table}" SELECT * FROM _privreg_psi_rows')
    finally:
        con.unregister("_privreg_psi_rows")


#: Rows of the digest table a step over all of it (the duplicate check, the rewrite in bucket
#: order) holds at once, slice by slice (docs/protocols/psi.md); a million ids fit one slice.
SLICE_ROWS = 1 << 20


def _slices(rows: int) -> list[tuple[int, int | None]]:
    """``(low, high)`` ranges of the first digest word (``high`` None: up to 2^64) that split
    ``rows`` uniform digests into slices of about :data:`SLICE_ROWS` rows."""
    count = max(1, math.ceil(rows / SLICE_ROWS))
    edges = [k * (1 << 64) // count for k in range(count)]
    return list(zip(edges, [*edges[1:], None], strict=True))


def _in_slice(low: int, high: int | None) -> str:
    return f"d0 >= {low}" + ("" if high is None else f" AND d0 < {high}")


@dataclass(frozen=True)
class DigestRows:
    """What :func:`_digest_rows` stored: the row count, the source table's fingerprint, and how
    many pieces it was read in (one: :func:`core.psi_ot.protocol.item_digests` has already
    compared every id with every other)."""

    rows: int
    fingerprint: str
    pieces: int


def _digest_rows(store: PartyStore, ref: TableRef, table: str) -> DigestRows:
    """Stream the source table, piece by piece, into ``table`` (row, d0, d1), each piece its
    own transaction (an uncommitted table is held in memory whole); refuses a bad id, or one
    repeated within a piece, naming party, table, column and row. The table's fingerprint is
    taken in the same read (:class:`storage.party_store.Fingerprint`)."""
    source, column = ref.table, ref.id_column
    with store.connect() as con:
        con.execute(f'CREATE OR REPLACE TABLE "{table}" (row BIGINT, d0 UBIGINT, d1 UBIGINT)')
    fingerprint, count, pieces = Fingerprint(ref, ids_checked=True), 0, 0  # item_digests checks
    with store.connect() as reader:
        for rowids, chunk in table_chunks(reader, source):
            ids = chunk[column].tolist()
            digests = kkrt.item_digests(ids, _where(ref), first_row=int(rowids[0]))
            words = digests.view("<u8")
            frame = pd.DataFrame({"row": rowids, "d0": words[:, 0], "d1": words[:, 1]})
            with store.transaction() as con:
                insert_frame(con, table, frame)
            fingerprint.update(chunk)
            count, pieces = count + len(chunk), pieces + 1
    return DigestRows(count, fingerprint.hexdigest(), pieces)


def _repeat_in(
    con: duckdb.DuckDBPyConnection, table: str, low: int, high: int | None
) -> tuple[int, int] | None:
    """``(row, first)``: the lowest row of one slice whose digest an earlier row has."""
    return con.execute(
        f"SELECT row, first FROM (SELECT row, min(row) OVER (PARTITION BY d0, d1) AS first "
        f'FROM "{table}" WHERE {_in_slice(low, high)}) WHERE row <> first ORDER BY row LIMIT 1'
    ).fetchone()


def _refuse_duplicates(store: PartyStore, ref: TableRef, table: str, rows: int) -> None:
    """Refuses the lowest row whose id an earlier row has, naming both rows. Equal ids have
    equal digests, so they meet in one slice; the slices are checked one at a time."""
    with store.connect() as con:
        found = [_repeat_in(con, table, low, high) for low, high in _slices(rows)]
        repeats = sorted(r for r in found if r is not None)
        if repeats:
            row, first = repeats[0]
            value = con.execute(
                f'SELECT "{ref.id_column}" FROM "{ref.table}" WHERE rowid = ?', [row]
            )
            raise psi.PsiError(
                f"{_where(ref)}: id at row {row + 1} duplicates row {first + 1} "
                f"({value.fetchone()[0]!r})"
            )


@task(name="psi-kkrt-ids", task_run_name="{ref.party}: hash own ids", **PARTY_STEP)
def prepare_ids(ref: TableRef, job_id: str) -> int:
    """Own ids as protocol inputs, in the party's digest table; returns the set size.

    Refusals (a null, unsupported or duplicate id) come before anything is sent or kept: a
    refused table's digests are dropped, and the ids count as prepared only once checked."""
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    done = artifacts.get(job_prefix(job_id) + "ids")
    if done is not None:
        return int(done["size"])
    if not store.has_table(ref.table):
        raise psi.PsiError(f"{ref.party}: no table {ref.table!r} in {store.path.name}")
    table = working_tables(job_id)[0]
    try:
        stored = _digest_rows(store, ref, table)
        if stored.pieces > 1:  # ids of different pieces have not met yet
            _refuse_duplicates(store, ref, table, stored.rows)
    except BaseException:
        with store.connect() as con:
            con.execute(f'DROP TABLE IF EXISTS "{table}"')
        raise
    state = {"size": stored.rows, "fingerprint": stored.fingerprint}
    artifacts.put(job_prefix(job_id) + "ids", state, "psi-state")
    return stored.rows


def table_source_digest(store: PartyStore, ref: TableRef, job_id: str) -> str:
    """The source table's fingerprint, taken when its ids were read (the rows this job
    matched), or now for a job that an older privreg started."""
    state = ArtifactStore(store).get(job_prefix(job_id) + "ids") or {}
    return state.get("fingerprint") or store.fingerprint(ref)


def plan_for(side: PsiSide) -> Plan:
    """Roles and buckets, from the own size and the peer's size message (waits for it)."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    size = ArtifactStore(PartyStore.of(ref)).get(job_prefix(job_id) + "ids")["size"]
    message = side.endpoint.receive(peer, kkrt.KIND_SIZE)
    return kkrt.plan(ref.party, peer, int(size), buckets.BUCKET_IDS, message)


def _by_bucket(store: PartyStore, job_id: str, plan: Plan) -> None:
    """Once the plan is known, rewrite the digest table in bucket order, about :data:`SLICE_ROWS`
    rows at a time (why: docs/protocols/psi.md). Idempotent: a retry finds the bucket column (or
    this process's mark), and a rewrite cut short starts again."""
    table = working_tables(job_id)[0]
    if plan.buckets == 1 or (str(store.path), table) in BUCKETED:
        return  # one bucket: every row is in it, no order to make
    with store.connect() as con:
        columns = con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table]
        ).fetchall()
    if ("bucket",) not in columns:
        ordered, count = f"{table}_by_bucket", int(plan.buckets)
        with store.connect() as con:
            con.execute(
                f'CREATE OR REPLACE TABLE "{ordered}" '
                "(bucket BIGINT, row BIGINT, d0 UBIGINT, d1 UBIGINT)"
            )
        group = max(1, SLICE_ROWS * count // max(plan.own_size, 1))
        for low in range(0, count, group):
            with store.transaction() as con:
                _insert_buckets(con, table, ordered, count, range(low, min(low + group, count)))
        with store.transaction() as con:
            con.execute(f'DROP TABLE "{table}"')
            con.execute(f'ALTER TABLE "{ordered}" RENAME TO "{table}"')
    BUCKETED.add((str(store.path), table))


def _insert_buckets(
    con: duckdb.DuckDBPyConnection, table: str, ordered: str, count: int, group: range
) -> None:
    """Appends the rows of the buckets ``group`` (of ``count``) to ``ordered``, in order."""
    con.execute(
        f'INSERT INTO "{ordered}" SELECT d0 % {count} AS bucket, row, d0, d1 FROM "{table}" '
        f"WHERE d0 % {count} >= {group.start} AND d0 % {count} < {group.stop} "
        "ORDER BY bucket, row"
    )


#: The digest tables this process has put in bucket order (dropped with the job's tables).
BUCKETED: set[tuple[str, str]] = set()


def bucket_rows(
    store: PartyStore, job_id: str, plan: Plan, bucket: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, digests)`` of one bucket (every id for ``None``), in row order (so a retry
    computes the same)."""
    table = working_tables(job_id)[0]
    if bucket is not None:
        _by_bucket(store, job_id, plan)
    every = bucket is None or plan.buckets == 1
    where, params = ("", []) if every else ("WHERE bucket = ? ", [bucket])
    with store.connect() as con:
        query = con.execute(f'SELECT row, d0, d1 FROM "{table}" {where}ORDER BY row', params)
        found = query.fetchnumpy()
    rows = np.asarray(found["row"], dtype=np.int64)
    words = np.empty((len(rows), 2), dtype="<u8")
    words[:, 0], words[:, 1] = found["d0"], found["d1"]
    return rows, words.view(np.uint8)


# ---- the base OTs, once per job --------------------------------------------------------------


@task(name="psi-kkrt-reply", task_run_name="{side.ref.party}: base-OT choices", **PARTY_STEP)
def send_reply(side: PsiSide) -> None:
    """Step 2 (sender): base-OT choices and the code key."""
    base_ots(side, False, kkrt)


def base_ots(side: PsiSide, receiver: bool, protocol: Any) -> None:
    """Step 1 (R): base-OT setup; step 2 (S): base-OT choices (KKRT16's with the code key).
    ``protocol``: :mod:`core.psi_ot.protocol` or :mod:`core.psi_ot.rr22`."""
    key, endpoint, peer = job_key(PartyStore.of(side.ref), side.job_id), side.endpoint, side.peer
    if receiver:
        endpoint.send(peer, protocol.KIND_HELLO, protocol.hello(key))
    else:
        hello = endpoint.receive(peer, protocol.KIND_HELLO)
        endpoint.send(peer, protocol.KIND_REPLY, protocol.reply(key, hello, peer))


# ---- per bucket ------------------------------------------------------------------------------


def bucket_done_key(job_id: str, bucket: int) -> str:
    return f"{job_prefix(job_id)}bucket/{bucket:06d}"


def pending_plan(side: PsiSide, bucket: int) -> Plan | None:
    """The plan, or None when an earlier attempt finished the bucket (its "done" mark)."""
    store = PartyStore.of(side.ref)
    with store.session():
        if ArtifactStore(store).has(bucket_done_key(side.job_id, bucket)):
            return None
        return plan_for(side)


def pending_bucket(side: PsiSide, bucket: int) -> tuple[Plan, bytes, np.ndarray] | None:
    """S: the plan, the job key and one bucket's digests (one opening of the database for the
    step's reads), or None when an earlier attempt sent the bucket (its "done" mark)."""
    store = PartyStore.of(side.ref)
    with store.session():
        if (plan := pending_plan(side, bucket)) is None:
            return None
        return plan, job_key(store, side.job_id), bucket_rows(store, side.job_id, plan, bucket)[1]


def held_key(side: PsiSide, table: int) -> tuple[str, str, int]:
    """Where a process keeps a side's secrets of one table (or bucket) between its steps."""
    return (str(PartyStore.of(side.ref).path), side.job_id, table)


#: R's OPRF outputs of a bucket between its matrix and its match, in this process only, never
#: on disk (a match in another process recomputes them from the job key: docs/protocols/psi.md).
_RECEIVER_STATES: dict[tuple[str, str, int], tuple[np.ndarray, kkrt.ReceiverState]] = {}


def _receiver_bucket(side: PsiSide, bucket: int) -> tuple[np.ndarray, kkrt.ReceiverExtension]:
    """R's rows of one bucket and its extension (deterministic: a recomputation gives the very
    matrix sent before). The cuckoo table is built before S's reply is awaited."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    with store.session():  # one opening of the database for the step's reads
        plan = plan_for(side)
        key = job_key(store, job_id)
        rows, digests = bucket_rows(store, job_id, plan, None if plan.one_table else bucket)
    table = kkrt.receiver_table(key, digests, plan, bucket)
    reply = side.endpoint.receive(peer, kkrt.KIND_REPLY)
    return rows, kkrt.extend(key, table, reply, plan, bucket, peer)


@task(
    name="psi-kkrt-matrix", task_run_name="{side.ref.party}: matrix, bucket {bucket}", **PARTY_STEP
)
def send_matrix(side: PsiSide, bucket: int) -> None:
    """Step 3 (receiver): one bucket's OT-extension columns; keeps its OPRF outputs, computed
    once the columns are sent (while the sender evaluates)."""
    plan = pending_plan(side, bucket)  # None: matched by an earlier attempt, not redone
    if plan is None or plan.matrix_round(bucket) != bucket:
        return  # or one table for every bucket: bucket 0's matrix serves them all
    rows, extension = _receiver_bucket(side, bucket)
    side.endpoint.send(side.peer, kkrt.KIND_MATRIX, extension.message, round=bucket)
    _RECEIVER_STATES[held_key(side, bucket)] = (rows, extension.state())


@task(
    name="psi-kkrt-values", task_run_name="{side.ref.party}: values, bucket {bucket}", **PARTY_STEP
)
def send_values(side: PsiSide, bucket: int) -> None:
    """Step 4 (sender): the OPRF of one bucket's items under each hash function; the items
    are padded, ordered and encoded before R's matrix is awaited."""
    if (pending := pending_bucket(side, bucket)) is None:
        return  # sent by an earlier attempt: not redone
    plan, key, digests = pending
    prepared = kkrt.sender_bucket(key, digests, plan, bucket)
    endpoint, peer = side.endpoint, side.peer
    hello = endpoint.receive(peer, kkrt.KIND_HELLO)
    matrix = endpoint.receive(peer, kkrt.KIND_MATRIX, round=plan.matrix_round(bucket))
    message = kkrt.evaluate(key, prepared, hello, matrix, plan, bucket, peer)
    endpoint.send(peer, kkrt.KIND_VALUES, message, round=bucket)
    done = bucket_done_key(side.job_id, bucket)
    ArtifactStore(PartyStore.of(side.ref)).put(done, {"sent": True}, "psi-state")


@task(name="psi-kkrt-match", task_run_name="{side.ref.party}: match, bucket {bucket}", **PARTY_STEP)
def match_bucket(side: PsiSide, bucket: int) -> None:
    """Step 5 (receiver): one bucket's matches, kept with the bucket's "done" mark."""
    if (plan := pending_plan(side, bucket)) is None:
        return
    table = plan.matrix_round(bucket)
    held = held_key(side, table)
    saved = _RECEIVER_STATES.get(held)
    if saved is None:  # matched in another process than the matrix: recomputed
        rows, extension = _receiver_bucket(side, table)
        saved = _RECEIVER_STATES[held] = (rows, extension.state())
    rows, state = saved
    values = side.endpoint.receive(side.peer, kkrt.KIND_VALUES, round=bucket)
    found = kkrt.match(state, values, side.peer)
    store_bucket_matches(side, bucket, found.positions, rows[found.result.rows])
    if not plan.one_table:  # the one table serves the next buckets too
        _RECEIVER_STATES.pop(held, None)


def store_bucket_matches(
    side: PsiSide, bucket: int, positions: np.ndarray, rows: np.ndarray
) -> None:
    """R: one bucket's matches (S's positions, own rows) and the bucket's "done" mark, in one
    transaction."""
    store, job_id = PartyStore.of(side.ref), side.job_id
    with store.transaction() as con:
        create_matches_table(con, job_id)
        insert_frame(con, working_tables(job_id)[1], _matches_frame(bucket, positions, rows))
        done = {"matched": len(rows)}
        ArtifactStore(store).put(bucket_done_key(job_id, bucket), done, "psi-state", con=con)


def _matches_frame(bucket: int, positions: np.ndarray, rows: np.ndarray) -> pd.DataFrame:
    """One bucket's rows of the match table: ``(bucket, position in S's order, own row)``."""
    buckets = np.full(len(rows), bucket, dtype=np.int64)
    return pd.DataFrame({"bucket": buckets, "pos": positions, "row": rows})


def create_matches_table(con: duckdb.DuckDBPyConnection, job_id: str) -> None:
    matches = working_tables(job_id)[1]
    con.execute(f'CREATE TABLE IF NOT EXISTS "{matches}" (bucket BIGINT, pos BIGINT, row BIGINT)')


# ---- release and write -----------------------------------------------------------------------


def write_aligned(
    side: PsiSide, con: duckdb.DuckDBPyConnection, sizes: tuple[int, int, int], source_digest: str
) -> dict[str, Any]:
    """The aligned table in (bucket, position) order, in the caller's transaction, with its
    lineage; the job's working tables and secrets go in the same transaction."""
    ref, job_id, store = side.ref, side.job_id, PartyStore.of(side.ref)
    size, own_size, peer_size = sizes
    table = aligned_table_name(ref)
    ids, matches = working_tables(job_id)
    con.execute(
        f'CREATE OR REPLACE TABLE "{table}" AS SELECT s.* FROM "{ref.table}" s '
        f'JOIN "{matches}" m ON s.rowid = m.row ORDER BY m.bucket, m.pos'
    )
    summary = {"table": table, "size": size, "own_size": own_size, "peer_size": peer_size}
    artifacts = ArtifactStore(store)
    OwnerPolicy(store).record_source(table, ref.table, con)  # the copy shares its budget
    artifacts.delete_prefix(job_prefix(job_id), con=con)  # key, states, marks
    artifacts.put(job_prefix(job_id) + "result", summary, "psi-result", con=con)
    lineage = Lineage(ref.table, source_digest, table, job_id)
    record(store, job_prefix(job_id), lineage, con)  # what a re-run may reuse it for
    for working in (ids, f"{ids}_by_bucket", matches):  # with a rewrite cut short
        con.execute(f'DROP TABLE IF EXISTS "{working}"')
    return summary


@dataclass(frozen=True)
class MatchedPositions:
    """What differs between the OT-based protocols at their end: the name (for the log), how R's
    matched positions (in S's order) travel (result and per-bucket kinds, R's encoding, S's
    decoding into ``(positions, indices among its bucket's rows)``), and the secrets a process
    keeps between steps (base-OT seeds' cache, per-table states keyed ``(store, job, table)``)."""

    name: str
    result_kind: str
    matched_kind: str
    encode: Callable[[np.ndarray, Plan], Any]
    decode: Callable[[bytes, int, Plan, int, Any, str], tuple[np.ndarray, np.ndarray]]
    forget_base_ots: Callable[[], None]
    held: tuple[dict[tuple[str, str, int], Any], ...]


def _finish(side: PsiSide, summary: dict[str, Any], carried: MatchedPositions) -> None:
    """Forget every secret of the finished job in this process, then destroy its sealed key
    (after the commit: a failed write keeps the job resumable)."""
    ref, job_id, store = side.ref, side.job_id, PartyStore.of(side.ref)
    JOB_KEYS.pop((str(store.path), job_id), None)
    carried.forget_base_ots()
    BUCKETED.discard((str(store.path), working_tables(job_id)[0]))
    for held in carried.held:
        for k in [k for k in held if k[:2] == (str(store.path), job_id)]:
            del held[k]
    sealed_scalars(store, job_prefix(job_id)).destroy()
    get_run_logger().info(
        "%s aligned %d of %d rows into %s (%s)",
        ref.party, summary["size"], summary["own_size"], summary["table"], carried.name,
    )  # fmt: skip


def release_matches(side: PsiSide, min_rows: int, carried: MatchedPositions) -> dict[str, Any]:
    """R, every bucket matched: the size, then (when released) each bucket's matched positions;
    then the aligned table. Refuses an empty or small intersection."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    with store.session():  # one opening of the database for the B reads
        plan = plan_for(side)
        size = sum(
            int(artifacts.get(bucket_done_key(job_id, b))["matched"]) for b in range(plan.buckets)
        )
    endpoint = side.endpoint
    endpoint.send(peer, carried.result_kind, kkrt.result_message(size, min_rows))
    psi.check_release_size(size, plan.own_size, plan.peer_size, min_rows)
    source_digest = table_source_digest(store, ref, job_id)
    with store.transaction() as con:
        create_matches_table(con, job_id)
        for bucket in range(plan.buckets):
            positions = con.execute(
                f'SELECT pos FROM "{working_tables(job_id)[1]}" WHERE bucket = ? ORDER BY pos',
                [bucket],
            ).fetchnumpy()["pos"]
            endpoint.send(peer, carried.matched_kind, carried.encode(positions, plan), bucket)
        summary = write_aligned(side, con, (size, plan.own_size, plan.peer_size), source_digest)
    _finish(side, summary, carried)
    return summary


def store_matched_rows(side: PsiSide, min_rows: int, carried: MatchedPositions) -> dict[str, Any]:
    """S: own rows at R's matched positions, bucket by bucket, written in the same order.
    Refuses a withheld, empty or small intersection and positions that do not decode."""
    ref, peer, job_id = side.ref, side.peer, side.job_id
    store = PartyStore.of(ref)
    key = job_key(store, job_id)
    plan = plan_for(side)
    endpoint = side.endpoint
    size = kkrt.released_size(endpoint.receive(peer, carried.result_kind), peer)
    psi.check_release_size(size, plan.own_size, plan.peer_size, min_rows)
    placed, source_digest = 0, table_source_digest(store, ref, job_id)
    with store.transaction() as con:
        con.execute(f'DROP TABLE IF EXISTS "{working_tables(job_id)[1]}"')  # an earlier attempt's
        create_matches_table(con, job_id)
        for bucket in range(plan.buckets):
            message = endpoint.receive(peer, carried.matched_kind, round=bucket)
            rows, _ = bucket_rows(store, job_id, plan, bucket)
            positions, at = carried.decode(key, len(rows), plan, bucket, message, peer)
            insert_frame(
                con, working_tables(job_id)[1], _matches_frame(bucket, positions, rows[at])
            )
            placed += len(at)
        if placed != size:
            raise psi.PsiError(
                f"{peer} announced {size} shared rows but matched {placed} positions: refused"
            )
        summary = write_aligned(side, con, (size, plan.own_size, plan.peer_size), source_digest)
    _finish(side, summary, carried)
    return summary


def _positions(
    key: bytes, real: int, plan: Plan, bucket: int, message: Any, peer: str
) -> tuple[np.ndarray, np.ndarray]:
    at = kkrt.sender_rows(key, real, plan, bucket, message, peer)
    return np.asarray(message["positions"]), at


KKRT_POSITIONS = MatchedPositions(
    "KKRT16",
    kkrt.KIND_RESULT,
    kkrt.KIND_POSITIONS,
    lambda positions, _plan: kkrt.positions_message(positions),
    _positions,
    kkrt.forget_base_ots,
    (_RECEIVER_STATES,),
)


@task(name="psi-kkrt-release", task_run_name="{side.ref.party}: release and store", **PARTY_STEP)
def release_and_store(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Step 5 (receiver): :func:`release_matches` with KKRT16's positions."""
    return release_matches(side, min_rows, KKRT_POSITIONS)


@task(name="psi-kkrt-finish", task_run_name="{side.ref.party}: store aligned rows", **PARTY_STEP)
def finish_and_store(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Step 6 (sender): :func:`store_matched_rows` from KKRT16's positions."""
    return store_matched_rows(side, min_rows, KKRT_POSITIONS)


# ---- whole sides -----------------------------------------------------------------------------

Step = Callable[..., Any]


def party_side(side: PsiSide, min_rows: int, call: Step = operator.call) -> dict[str, Any]:
    """One party's whole side in its role's order; ``call(task, *args)`` runs each step (as a
    Prefect task by default; a benchmark's calls ``task.fn``). The database stays open through the
    side (an opening cost 30-90 ms of CPU, twenty a job at 100k ids); other processes wait."""
    with PartyStore.of(side.ref).session():
        return _side(side, min_rows, call)


@task(
    name="psi-kkrt-start", task_run_name="{side.ref.party}: own ids, sizes, base OTs", **PARTY_STEP
)
def start_side(side: PsiSide) -> Plan:
    """Steps 0 to 2 of one party's side as one task run (a task run costs 0.1-0.4 s of a
    loaded machine): :func:`start`."""
    return start(side, kkrt)


def start(side: PsiSide, protocol: Any) -> Plan:
    """Steps 0 to 2 of KKRT16 or RR22 (:func:`base_ots`' ``protocol``): own ids, the set size and
    bucket size, the plan, then R's base-OT setup or S's choices. Each is idempotent, so a retry
    redoes only what had not finished."""
    size = prepare_ids.fn(side.ref, side.job_id)
    side.endpoint.send(side.peer, kkrt.KIND_SIZE, kkrt.size_message(size, buckets.BUCKET_IDS))
    plan = plan_for(side)
    base_ots(side, plan.receiver, protocol)
    return plan


@task(
    name="psi-kkrt-receive-one",
    task_run_name="{side.ref.party}: matrix, match, store",
    **PARTY_STEP,
)
def receiver_one_bucket(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Steps 3 and 5 of a job of one bucket as one task run (the receiver's rest of the side in
    two task runs, not three); each step is idempotent: a retry redoes only what had not ended."""
    send_matrix.fn(side, 0)
    match_bucket.fn(side, 0)
    return release_and_store.fn(side, min_rows)


@task(name="psi-kkrt-send-one", task_run_name="{side.ref.party}: values, store", **PARTY_STEP)
def sender_one_bucket(side: PsiSide, min_rows: int) -> dict[str, Any]:
    """Steps 4 and 6 of a job of one bucket as one task run (as :func:`receiver_one_bucket`)."""
    send_values.fn(side, 0)
    return finish_and_store.fn(side, min_rows)


def _side(side: PsiSide, min_rows: int, call: Step) -> dict[str, Any]:
    plan = call(start_side, side)
    if plan.buckets == 1:  # nothing to pipeline: the rest of the side in one task run
        rest = receiver_one_bucket if plan.receiver else sender_one_bucket
        return call(rest, side, min_rows)
    if plan.receiver:
        call(send_matrix, side, 0)
        for bucket in range(plan.buckets):  # the next matrix goes out before this match
            if bucket + 1 < plan.buckets:
                call(send_matrix, side, bucket + 1)
            call(match_bucket, side, bucket)
        return call(release_and_store, side, min_rows)
    for bucket in range(plan.buckets):
        call(send_values, side, bucket)
    return call(finish_and_store, side, min_rows)
