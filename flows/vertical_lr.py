"""Flow ``vertical_lr``: logistic regression on features split across parties (Paillier).

    hosts ── [[Xh wh / 4]] ──▶ guest ── [[d]] (re-randomised) ──▶ hosts
    guest, hosts ── [[X^T d]] + own mask ──▶ key holder ── X^T d + mask ──▶ owner
    guest ── [[Taylor loss]] ──▶ key holder ── loss ──▶ early stopping
    every party: unmask, step, checkpoint the round           (repeat per mini-batch)

The key holder is an arbiter, or the guest itself with ``arbiter=False`` (seed 003's
two-party mode; see the README for what each side learns then).
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Completed, State

from core.outcomes import BELOW_BASELINE
from core.paillier.keys import check_key_size
from core.paillier.randomness import DEFAULT_RANDOMIZER, randomizer_mode
from core.preprocessing import PreprocessingSpec
from federation.workspace import derive_job_id
from flows.local_run import LocalJob, LocalSide, run_locally
from flows.vertical_party import FAULT_VARIABLE, InjectedFaultError, vertical_lr_party
from storage.descriptor import TableRef
from tasks import vertical_lr as steps
from tasks.loading import fingerprint
from tasks.reporting import run_namer

__all__ = ["FAULT_VARIABLE", "InjectedFaultError", "vertical_lr"]

ARBITER = "arbiter"


@flow(name="vertical_lr", flow_run_name=run_namer("vertical_lr"))
def vertical_lr(
    guest: dict[str, Any],
    hosts: list[dict[str, Any]],
    epochs: int = 5,
    batch_size: int = 1024,
    learning_rate: float = 0.15,
    momentum: float = 0.9,
    decay: float = 0.0,
    l2: float = 0.0,
    tol: float = 1e-5,
    key_size: int = 2048,
    seed: int = 0,
    holdout_fraction: float = 0.1,
    arbiter: bool = True,
    arbiter_database: str | None = None,
    workspace: str | None = None,
    job_id: str | None = None,
    randomizer: str = DEFAULT_RANDOMIZER,
    clip_features: float | None = None,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any] | State:
    """Train locally, every party's ``vertical_lr_party`` side in this process; returns the
    guest's slice (its coefficients, metrics, scores table) and the round history. Each host's
    coefficients stay in its own store (``models/vertical/...``).

    ``job_id`` defaults to one derived from the tables' salted fingerprints and every
    option except ``epochs`` (so a run with more epochs continues the same job).
    ``clip_features`` clips every party's features to [-c, c] locally (standardised data).
    ``randomizer`` picks the Paillier obfuscators: ``"full"`` (default: fixed-base h_s^r with
    r < n, semantically secure under DCR alone), ``"short"`` (``"djn"``: r of k/2 bits, about
    1.6x cheaper, needs an extra short-exponent assumption) or ``"standard"`` (textbook r^n,
    slowest); see core/paillier/randomness.py for the security statement.

    Args:
        guest: Descriptor of the guest's aligned table (holds the labels and some features).
        hosts: Descriptors of the hosts' aligned tables (features only), one per host.
        epochs: Passes over the training rows; more epochs on the same job continue it.
        batch_size: Rows per mini-batch (one protocol round per batch).
        learning_rate: Step size of the momentum gradient descent.
        momentum: Momentum of the gradient descent (0 for plain steps).
        decay: Learning-rate decay per epoch.
        l2: L2 penalty on the coefficients.
        tol: Stop once an epoch's mean loss changes by less than this.
        key_size: Paillier modulus bits (2048 by default; smaller only for tests).
        seed: Seed of the public batch schedule and hold-out split.
        holdout_fraction: Share of rows held out for the hold-out loss and metrics.
        arbiter: Let an arbiter hold the key (False: the guest holds it, two-party mode).
        arbiter_database: The arbiter's database (default: under the workspace).
        workspace: Folder for run messages and the arbiter (default: var or PRIVREG_HOME).
        job_id: Job to continue; default derived from the tables and options. Give the id
            a key and pools were prepared for ahead of the run (``privreg paillier``).
        randomizer: Paillier obfuscators: "full" (default), "short" (also "djn": about 1.6x
            cheaper, an extra assumption) or "standard" (textbook, slowest).
        clip_features: Clip every party's features to [-c, c] locally; None keeps them.
        preprocessing: The job's preprocessing (scaling, imputation; default: standardise):
            each party fits it on its own columns, nothing leaves it.

    A loss that becomes non-finite or rises far above the first round's stops the run with
    ``DivergenceError``; a model no better than the class prior on held-out rows ends in the
    COMPLETED state named "Below baseline" (its result is the same dictionary).
    """
    randomizer_mode(randomizer)  # an unknown name fails here, before any key is made
    check_key_size(key_size)  # below 2048 bits: this process's opt-in (tests only)
    spec = PreprocessingSpec.from_dict(preprocessing)
    guest_ref = TableRef.from_dict(guest)
    host_refs = [TableRef.from_dict(h) for h in hosts]
    if not host_refs:
        raise steps.VerticalSetupError("vertical_lr needs at least one host")
    if not arbiter and len(host_refs) != 1:
        raise steps.VerticalSetupError("two-party mode (arbiter=False) takes exactly one host")
    names = [guest_ref.party, *[h.party for h in host_refs]]
    if len(set(names)) != len(names) or ARBITER in names:
        raise steps.VerticalSetupError(f"party names must be distinct and not 'arbiter': {names}")
    options = {
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "momentum": momentum,
        "decay": decay,
        "l2": l2,
        "key_size": key_size,
        "seed": seed,
        "holdout_fraction": holdout_fraction,
        "randomizer": randomizer,
        "clip_features": clip_features,
        "preprocessing": spec.to_dict(),
    }
    if job_id is None:
        tables = [[r.party, r.table, fingerprint(r)] for r in (guest_ref, *host_refs)]
        job_id = derive_job_id("vertical", {"tables": tables, **options, "arbiter": arbiter})
    shared = {
        "job_id": job_id,
        "guest": guest_ref.party,
        "hosts": [h.party for h in host_refs],
        "arbiter": ARBITER if arbiter else None,
        "arbiter_database": arbiter_database,
        "epochs": epochs,
        "tol": tol,
        **options,
    }
    roles = [("guest", guest_ref), *(("host", h) for h in host_refs)]
    sides = [LocalSide(ref.party, _side(role, ref, shared)) for role, ref in roles]
    if arbiter:
        sides.append(LocalSide(ARBITER, _side(ARBITER, None, shared)))
    result = run_locally(LocalJob(sides, workspace, job=job_id))[guest_ref.party]
    if isinstance(result, State):  # the guest's "Below baseline": still COMPLETED
        result = result.result()
    if str(result.get("outcome", "")).startswith(BELOW_BASELINE):
        return Completed(name=BELOW_BASELINE, message=result["outcome"], data=result)
    return result


def _side(role: str, ref: TableRef | None, shared: dict[str, Any]) -> Any:
    own = ref.to_dict() if ref is not None else None
    return lambda: vertical_lr_party(role, own=own, **shared)
