"""Flow ``psi_align``: align two parties' tables on their id columns by private set intersection.

party R (receiver)                          party S (sender)
hash own ids into buckets  ◀── sizes ──▶  hash own ids into buckets
base-OT setup              ── hello ───▶
                           ◀── reply ───  base-OT choices, code key
per bucket k:  OT-extension columns ── matrix_k ──▶
                                    ◀── values_k ──  OPRF of S's bucket k
               match, keep
the size (min_rows), then positions per bucket ───▶
aligned rows                                         aligned rows   (same order on both sides)

With ``protocol: "rr22"`` (tasks/psi_rr22.py) each bucket takes four messages instead of two: a
silent VOLE (extend, vole) before R's OKVS (okvs) and S's values; the rest is the same.

More (the protocol, what each party learns, why): docs/protocols/psi.md.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger

from core.job_schema import PsiOptions
from federation.workspace import derive_job_id
from flows.local_run import run_pair
from flows.stage_options import keyword_options
from storage.descriptor import TableRef
from tasks import psi as steps
from tasks import psi_kkrt, psi_rr22
from tasks.loading import fingerprint
from tasks.reporting import run_namer
from tasks.summaries import psi_summary

_DERIVED = re.compile(r"psi-[0-9a-f]{16}")  # a direct call's job id (derive_job_id)


@flow(name="psi_align", flow_run_name=run_namer("psi_align"))
@keyword_options(PsiOptions)
def psi_align(
    party_a: dict[str, Any],
    party_b: dict[str, Any],
    workspace: str | None = None,
    job_id: str | None = None,
    *,
    options: PsiOptions,
) -> dict[str, Any]:
    """Align two tables locally: both parties' ``psi_align_party`` sides, in this process.

    Returns the intersection size and each party's aligned descriptor. Re-running on
    unchanged inputs reuses the stored alignment (the job id is derived from both parties'
    salted table fingerprints).

    Args:
        party_a: Descriptor of the first party's table (database, table, party, id column).
        party_b: Descriptor of the second party's table.
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
        job_id: The job to run or reuse; default derived from the tables (see above).
    """
    a, b = two_tables(party_a, party_b)
    job_id = job_id or _local_job_id(a, b, options.min_rows, options.protocol)
    outcome, results = run_both(
        a, b, job_id, lambda own, peer: psi_align_party(own, peer, job_id, options), workspace
    )
    return {**outcome, "aligned": [r["aligned"] for r in results]}


def two_tables(party_a: dict[str, Any], party_b: dict[str, Any]) -> tuple[TableRef, TableRef]:
    """The two descriptors of a local PSI, refused if one party holds both."""
    a, b = TableRef.from_dict(party_a), TableRef.from_dict(party_b)
    if a.party == b.party:
        raise ValueError(f"both tables belong to party {a.party!r}; PSI needs two parties")
    return a, b


def table_inputs(a: TableRef, b: TableRef) -> dict[str, Any]:
    """What names a local PSI's job: both tables and their salted fingerprints."""
    return {"a": [a.party, a.table, fingerprint(a)], "b": [b.party, b.table, fingerprint(b)]}


def run_both(
    a: TableRef,
    b: TableRef,
    job_id: str,
    side: Callable[[dict[str, Any], str], dict[str, Any]],
    workspace: str | None,
) -> tuple[dict[str, Any], tuple[dict[str, Any], dict[str, Any]]]:
    """Both sides of a PSI flow run locally, then the run's summary; returns the figures both
    learn (the size, both set sizes, reused or not) and each side's own result."""
    results = run_pair(a, b, lambda own, peer, _: side(own.to_dict(), peer), workspace, job_id)
    sizes = [r["set_sizes"][0] for r in results]
    shared = results[0]["intersection_size"]
    psi_summary(job_id, [a, b], sizes, shared, workspace)
    reused = all(r["reused"] for r in results)
    figures = {"job_id": job_id, "intersection_size": shared, "set_sizes": sizes, "reused": reused}
    return figures, results


def _local_job_id(a: TableRef, b: TableRef, min_rows: int, protocol: str) -> str:
    """The job id of a local alignment: derived from both tables' salted fingerprints, so
    unchanged tables reuse their alignment (or another job's standing alignment of the same
    tables); a fresh id if a stored one no longer matches."""
    inputs: dict[str, Any] = {**table_inputs(a, b), "min_rows": min_rows}
    if protocol != "ecdh":  # ECDH jobs keep the ids they had before the option existed
        inputs["protocol"] = protocol
    job_id = derive_job_id("psi", inputs)
    stored = [steps.stored_alignment(r, job_id, refuse_changed=False) for r in (a, b)]
    if stored == [None, None] and (current := _current_alignment(a, b, min_rows)) is not None:
        return current  # another job (a job file's PSI) aligned these very tables already
    if any(s is not None and "changed" in s for s in stored):
        fresh = {**inputs, "replaces": job_id, "nonce": secrets.token_hex(8)}
        job_id = derive_job_id("psi", fresh)
        get_run_logger().info("re-aligning as job %s", job_id)
    return job_id


def _current_alignment(a: TableRef, b: TableRef, min_rows: int) -> str | None:
    """The job file's job whose alignment of these two tables stands at both parties (see
    :func:`tasks.psi.current_alignment`), if it is one job. Another direct call's alignment
    (a derived id) is not taken: its inputs, the protocol among them, named it."""
    jobs = {steps.current_alignment(r, min_rows) for r in (a, b)}
    if len(jobs) != 1 or (job := jobs.pop()) is None or _DERIVED.fullmatch(job):
        return None
    get_run_logger().info("reused the alignment of job %s (the tables are unchanged)", job)
    return job


@flow(name="psi_align_party", flow_run_name="psi_align {job_id}: {own[party]} with {peer}")
def psi_align_party(
    own: dict[str, Any], peer: str, job_id: str, options: PsiOptions
) -> dict[str, Any]:
    """One party's side of the alignment; its result names only its own aligned table. A
    re-run of a finished job reuses the stored alignment.

    Args:
        own: Descriptor of this party's own table.
        peer: Name of the other party (as its certificate names it).
        job_id: Job name agreed between the two parties.
        options: The smallest intersection and the protocol (both parties pass the same).
    """
    min_rows = options.min_rows
    ref = TableRef.from_dict(own)
    result = steps.stored_alignment(ref, job_id)
    reused = result is not None
    side = steps.PsiSide.of(ref, peer, job_id)
    if result is None and options.protocol in ("kkrt", "rr22"):
        result = (psi_kkrt if options.protocol == "kkrt" else psi_rr22).party_side(side, min_rows)
    elif result is None:
        steps.blind_own_ids(side)
        steps.blind_peer_ids(side)
        result = steps.store_aligned_rows(side, min_rows)
    return {
        "job_id": job_id,
        "intersection_size": result["size"],
        "aligned": ref.with_table(result["table"]).to_dict(),
        "set_sizes": [result["own_size"], result["peer_size"]],
        "reused": reused,
    }
