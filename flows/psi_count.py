"""Flow ``psi_count``: how many ids two parties' tables share, and nothing about which rows.

party A                                     party B
blind own ids   ── H(a)^x, sorted ────────▶
                ◀──────── H(b)^y, sorted ──  blind own ids
answer shuffled ── H(b)^yx, sorted ───────▶
                ◀─────── H(a)^xy, sorted ──  answer shuffled
count                                        count          (the same number on both sides)

``psi_count`` runs both sides in one process; ``psi_count_party`` is one side, run at each
organisation with an agreed job id. No table is written: each party stores the count only.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from federation.workspace import derive_job_id
from storage.descriptor import TableRef
from tasks import psi_count as steps
from tasks.loading import fingerprint


@flow(name="psi_count")
def psi_count(
    party_a: dict[str, Any],
    party_b: dict[str, Any],
    min_rows: int = 100,
    workspace: str | None = None,
) -> dict[str, Any]:
    """Count the ids both tables hold; each party learns the count and the other's set size.

    Args:
        party_a: Descriptor of the first party's table.
        party_b: Descriptor of the second party's table.
        min_rows: Refuse to release a count below this.
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
    """
    a, b = TableRef.from_dict(party_a), TableRef.from_dict(party_b)
    if a.party == b.party:
        raise ValueError(f"both tables belong to party {a.party!r}; PSI needs two parties")
    job_id = derive_job_id(
        "psi-count",
        {
            "a": [a.party, a.table, fingerprint(a)],
            "b": [b.party, b.table, fingerprint(b)],
            "min_rows": min_rows,
        },
    )
    stored = [steps.stored_count(a, job_id), steps.stored_count(b, job_id)]
    if all(stored):
        get_run_logger().info("inputs unchanged: reused count of job %s", job_id)
        results = stored
    else:
        sizes = [steps.blind_own_ids(a, b.party, job_id, workspace)]
        sizes.append(steps.blind_own_ids(b, a.party, job_id, workspace))
        steps.answer_peer(a, b.party, job_id, workspace)
        steps.answer_peer(b, a.party, job_id, workspace)
        results = [
            steps.count_shared(a, b.party, job_id, sizes[0], min_rows, workspace),
            steps.count_shared(b, a.party, job_id, sizes[1], min_rows, workspace),
        ]
    return {
        "job_id": job_id,
        "intersection_size": results[0]["size"],
        "set_sizes": [results[0]["own_size"], results[1]["own_size"]],
        "reused": all(stored),
    }


@flow(name="psi_count_party", flow_run_name="psi_count {job_id}: {own[party]} with {peer}")
def psi_count_party(
    own: dict[str, Any], peer: str, job_id: str, min_rows: int = 100
) -> dict[str, Any]:
    """One party's side of ``psi_count``; both parties run it with the same job id.

    Args:
        own: Descriptor of this party's own table.
        peer: Name of the other party (as its certificate names it).
        job_id: Job name agreed between the two parties.
        min_rows: Smallest count this party releases.
    """
    ref = TableRef.from_dict(own)
    result = steps.stored_count(ref, job_id)
    if result is None:
        own_size = steps.blind_own_ids(ref, peer, job_id)
        steps.answer_peer(ref, peer, job_id)
        result = steps.count_shared(ref, peer, job_id, own_size, min_rows)
    return {
        "job_id": job_id,
        "intersection_size": result["size"],
        "set_sizes": [result["own_size"], result["peer_size"]],
    }
