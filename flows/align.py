"""Flow ``psi_align``: align two parties' tables on their id columns by private set intersection.

The default protocol is KKRT16 (OT extension, :mod:`tasks.psi_kkrt`), run bucket by bucket;
R is the party with the smaller set:

party R (receiver)                          party S (sender)
hash own ids into buckets  ◀── sizes ──▶  hash own ids into buckets
base-OT setup              ── hello ───▶
                           ◀── reply ───  base-OT choices, code key
per bucket k:  OT-extension columns ── matrix_k ──▶
                                    ◀── values_k ──  OPRF of S's bucket k
               match, keep
the size (min_rows), then positions per bucket ───▶
aligned rows                                         aligned rows   (same order on both sides)

``protocol="ecdh"`` runs X25519 Diffie-Hellman PSI (:mod:`tasks.psi`: each side blinds its
ids, then the peer's; equal ids meet as equal doubly-blinded points), with the same
guarantees and the same intersection.

``psi_align`` runs both sides in one process (the embedded mode). ``psi_align_party`` is one
side, run by a party service at its own organisation: both parties run it with the same job id,
each on its own table, and each executes only its own column of the diagram above.
"""

from __future__ import annotations

import secrets
from typing import Any

from prefect import flow, get_run_logger

from storage.descriptor import TableRef
from storage.workspace import derive_job_id
from tasks import psi as steps
from tasks import psi_kkrt
from tasks.loading import fingerprint
from tasks.reporting import run_namer
from tasks.summaries import psi_summary

PROTOCOLS = ("ecdh", "kkrt")


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown PSI protocol {protocol!r}; choose one of {PROTOCOLS}")


@flow(name="psi_align", flow_run_name=run_namer("psi_align"))
def psi_align(
    party_a: dict[str, Any],
    party_b: dict[str, Any],
    min_rows: int = 100,
    workspace: str | None = None,
    protocol: str = "kkrt",
) -> dict[str, Any]:
    """Align two tables; returns the intersection size and each party's aligned descriptor.

    Re-running on unchanged inputs reuses the stored alignment (the job id is derived from
    both parties' salted table fingerprints).

    Args:
        party_a: Descriptor of the first party's table (database, table, party, id column).
        party_b: Descriptor of the second party's table.
        min_rows: Refuse an intersection smaller than this many rows.
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
        protocol: ``"kkrt"`` (OT extension, KKRT16; the default) or ``"ecdh"`` (X25519).
    """
    a, b = TableRef.from_dict(party_a), TableRef.from_dict(party_b)
    if a.party == b.party:
        raise ValueError(f"both tables belong to party {a.party!r}; PSI needs two parties")
    _check_protocol(protocol)
    inputs: dict[str, Any] = {
        "a": [a.party, a.table, fingerprint(a)],
        "b": [b.party, b.table, fingerprint(b)],
        "min_rows": min_rows,
    }
    if protocol != "ecdh":  # ECDH jobs keep the ids they had before the option existed
        inputs["protocol"] = protocol
    job_id = derive_job_id("psi", inputs)
    stored = [steps.stored_alignment(r, job_id, refuse_changed=False) for r in (a, b)]
    if any(s is not None and "changed" in s for s in stored):
        # both sides run here: align again under a fresh id (a party's side refuses instead)
        fresh = {**inputs, "replaces": job_id, "nonce": secrets.token_hex(8)}
        job_id = derive_job_id("psi", fresh)
        get_run_logger().info("re-aligning as job %s", job_id)
        stored = [None, None]
    if all(stored):
        get_run_logger().info("inputs unchanged: reused alignment of job %s", job_id)
        results = stored
    elif protocol == "kkrt":
        results = psi_kkrt.run_both(a, b, job_id, min_rows, workspace)
    else:
        steps.blind_own_ids(a, b.party, job_id, workspace)
        steps.blind_own_ids(b, a.party, job_id, workspace)
        steps.blind_peer_ids(a, b.party, job_id, workspace)
        steps.blind_peer_ids(b, a.party, job_id, workspace)
        results = [
            steps.store_aligned_rows(a, b.party, job_id, min_rows, workspace),
            steps.store_aligned_rows(b, a.party, job_id, min_rows, workspace),
        ]
    psi_summary(job_id, [a, b], [r["own_size"] for r in results], results[0]["size"], workspace)
    return {
        "job_id": job_id,
        "intersection_size": results[0]["size"],
        "reused": all(stored),
        "aligned": [
            ref.with_table(r["table"]).to_dict() for ref, r in zip((a, b), results, strict=True)
        ],
        "set_sizes": [results[0]["own_size"], results[1]["own_size"]],
    }


@flow(name="psi_align_party", flow_run_name="psi_align {job_id}: {own[party]} with {peer}")
def psi_align_party(
    own: dict[str, Any], peer: str, job_id: str, min_rows: int = 100, protocol: str = "kkrt"
) -> dict[str, Any]:
    """One party's side of the alignment; its result names only its own aligned table.

    ``job_id`` is agreed between the parties (the job's name); a re-run of a finished job
    reuses the stored alignment.

    Args:
        own: Descriptor of this party's own table.
        peer: Name of the other party (as its certificate names it).
        job_id: Job name agreed between the two parties.
        min_rows: Smallest intersection either party accepts.
        protocol: ``"kkrt"`` (the default) or ``"ecdh"``; both parties must pass the same.
    """
    _check_protocol(protocol)
    ref = TableRef.from_dict(own)
    result = steps.stored_alignment(ref, job_id)
    if result is None and protocol == "kkrt":
        result = psi_kkrt.run_party(ref, peer, job_id, min_rows)
    elif result is None:
        steps.blind_own_ids(ref, peer, job_id)
        steps.blind_peer_ids(ref, peer, job_id)
        result = steps.store_aligned_rows(ref, peer, job_id, min_rows)
    return {
        "job_id": job_id,
        "intersection_size": result["size"],
        "aligned": ref.with_table(result["table"]).to_dict(),
        "set_sizes": [result["own_size"], result["peer_size"]],
    }
