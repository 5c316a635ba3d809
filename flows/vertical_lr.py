"""Flow ``vertical_lr``: logistic regression on features split across parties (Paillier).

Every party's side (:mod:`flows.vertical_party`, the protocol's messages) in this process.
More (the protocol, what each party learns, why): docs/protocols/vertical-lr.md.
"""

from __future__ import annotations

import functools
from typing import Any

from prefect import flow
from prefect.states import Completed, State

from core.job_schema import VerticalOptions
from core.outcomes import BELOW_BASELINE
from core.paillier.keys import check_key_size
from core.preprocessing import PreprocessingSpec
from federation.workspace import derive_job_id
from flows.local_run import LocalJob, LocalSide, run_locally
from flows.stage_options import keyword_options
from flows.vertical_party import FAULT_VARIABLE, InjectedFaultError, vertical_lr_party
from storage.descriptor import TableRef
from tasks import vertical_lr as steps
from tasks.loading import fingerprint
from tasks.reporting import run_namer

__all__ = ["FAULT_VARIABLE", "InjectedFaultError", "vertical_lr"]

ARBITER = "arbiter"


@flow(name="vertical_lr", flow_run_name=run_namer("vertical_lr"))
@keyword_options(VerticalOptions)
def vertical_lr(
    guest: dict[str, Any],
    hosts: list[dict[str, Any]],
    workspace: str | None = None,
    job_id: str | None = None,
    preprocessing: dict[str, Any] | None = None,
    *,
    options: VerticalOptions,
) -> dict[str, Any] | State:
    """Train locally, every party's ``vertical_lr_party`` side in this process; returns the
    guest's slice (its coefficients, metrics, scores table) and the round history. Each host's
    coefficients stay in its own store (``models/vertical/...``).

    A diverging loss raises ``DivergenceError``; a model no better than the class prior on
    held-out rows ends in the COMPLETED state "Below baseline" carrying the same result.
    More (job ids, keys prepared ahead, randomizers): docs/protocols/vertical-lr.md.

    Args:
        guest: Descriptor of the guest's aligned table (holds the labels and some features).
        hosts: Descriptors of the hosts' aligned tables (features only), one per host.
        workspace: Folder for run messages and the arbiter (default: var or PRIVREG_HOME).
        job_id: Job to continue; default derived from the tables and options.
        preprocessing: The job's preprocessing (scaling, imputation; default: standardise):
            each party fits it on its own columns, nothing leaves it.
    """
    check_key_size(options.key_size)  # below 2048 bits: this process's opt-in (tests only)
    spec = PreprocessingSpec.from_dict(preprocessing)
    guest_ref = TableRef.from_dict(guest)
    host_refs = [TableRef.from_dict(h) for h in hosts]
    if not host_refs:
        raise steps.VerticalSetupError("vertical_lr needs at least one host")
    if not options.arbiter and len(host_refs) != 1:
        raise steps.VerticalSetupError("two-party mode (arbiter=False) takes exactly one host")
    names = [guest_ref.party, *[h.party for h in host_refs]]
    if len(set(names)) != len(names) or ARBITER in names:
        raise steps.VerticalSetupError(f"party names must be distinct and not 'arbiter': {names}")
    if job_id is None:
        tables = [[r.party, r.table, fingerprint(r)] for r in (guest_ref, *host_refs)]
        # the id's inputs as before: tables, shaping options, preprocessing, arbiter
        named = options.model_dump(exclude={"epochs", "tol", "arbiter_database"})
        job_id = derive_job_id(
            "vertical", {"tables": tables, **named, "preprocessing": spec.to_dict()}
        )
    parties = {"job_id": job_id, "guest": guest_ref.party, "hosts": [h.party for h in host_refs]}
    side = functools.partial(
        vertical_lr_party, **parties, options=options, preprocessing=spec.to_dict()
    )
    roles = [("guest", guest_ref), *(("host", h) for h in host_refs)]
    sides = [
        LocalSide(r.party, functools.partial(side, role, own=r.to_dict())) for role, r in roles
    ]
    if options.arbiter:
        sides.append(LocalSide(ARBITER, functools.partial(side, ARBITER)))
    result = run_locally(LocalJob(sides, workspace, job=job_id))[guest_ref.party]
    if isinstance(result, State):  # the guest's "Below baseline": still COMPLETED
        result = result.result()
    if str(result.get("outcome", "")).startswith(BELOW_BASELINE):
        return Completed(name=BELOW_BASELINE, message=result["outcome"], data=result)
    return result
