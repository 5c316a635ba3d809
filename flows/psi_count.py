"""Flow ``psi_count``: how many ids two parties' tables share, and nothing about which rows.

party A                                     party B
blind own ids   ── H(a)^x, sorted ────────▶
                ◀──────── H(b)^y, sorted ──  blind own ids
answer shuffled ── H(b)^yx, sorted ───────▶
                ◀─────── H(a)^xy, sorted ──  answer shuffled
count                                        count          (the same number on both sides)

More (the protocol, what each party learns, why): docs/protocols/psi.md.
"""

from __future__ import annotations

import functools
from typing import Any

from prefect import flow, get_run_logger

from federation.workspace import derive_job_id
from flows.align import run_both, table_inputs, two_tables
from storage.descriptor import TableRef
from tasks import psi_count as steps
from tasks.psi import PsiSide


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
    a, b = two_tables(party_a, party_b)
    job_id = derive_job_id("psi-count", {**table_inputs(a, b), "min_rows": min_rows})
    side = functools.partial(psi_count_party, job_id=job_id, min_rows=min_rows)
    return run_both(a, b, job_id, side, workspace)[0]


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
    reused = result is not None
    if result is None:
        side = PsiSide.of(ref, peer, job_id)
        own_size = steps.blind_own_ids(side)
        steps.answer_peer(side)
        result = steps.count_shared(side, own_size, min_rows)
    else:
        get_run_logger().info("inputs unchanged: reused count of job %s", job_id)
    return {
        "job_id": job_id,
        "intersection_size": result["size"],
        "set_sizes": [result["own_size"], result["peer_size"]],
        "reused": reused,
    }
