"""Pooled preprocessing statistics for parties holding different rows, one party's step each.

More: docs/data.md (preprocessing, and the pooled statistics).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from prefect import task

from core import preprocessing as pp
from federation.channel import PartyEndpoint
from federation.workspace import channel_for
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import secure_sum
from tasks.policy import PARTY_STEP
from tasks.secure_sum import COORDINATOR, SumContext, coordinator_store
from tasks.summaries import holdout_split

PROTOCOL = "preprocessing"
_SPLIT = 2.0**32

Holdout = float | Callable[[int], np.ndarray]
"""A party's held-out rows, which stay out of the sums as out of training: a share split by
the job id (``tasks.summaries.holdout_split``, horizontal LR) or a function from the row count
to the held-out rows (a flow with its own split, sparse LDA's ``SparseLDAJob.holdout_rows``)."""


class PreprocessingRefusalError(ValueError):
    """A party refuses statistics fitted for another spec or other columns (names both)."""


def _key(job_id: str, name: str) -> str:
    return f"{PROTOCOL}/{job_id}/{name}"


def channel_job(job_id: str) -> str:
    """The statistics' own message job, so their sessions never share a round number (and a
    message key) with the training job's rounds."""
    return f"{job_id}.pre"


def _endpoint(job_id: str, party: str) -> PartyEndpoint:
    """``party``'s end of the statistics' channel (:func:`channel_job`)."""
    return channel_for(channel_job(job_id)).endpoint(party)


def wide(values: np.ndarray) -> np.ndarray:
    """``values`` as exact (hi, lo) parts with ``v = hi * 2^32 + lo``, ``0 <= lo < 2^32``."""
    values = np.asarray(values, dtype=float)
    hi = np.floor(values / _SPLIT)
    return np.concatenate([hi, values - hi * _SPLIT])


def narrow(parts: np.ndarray) -> np.ndarray:
    half = len(parts) // 2
    return parts[:half] * _SPLIT + parts[half:]


def needs_statistics(spec: pp.PreprocessingSpec) -> bool:
    return spec.scaling != "none" or spec.impute != "none"


def pooled_spec(
    preprocessing: dict[str, Any] | None, flow: str, indicators: bool = False
) -> pp.PreprocessingSpec:
    """The job's spec for rows split across parties (horizontal LR, sparse LDA).

    ``indicators``: whether the flow trains on the fitted transform's output columns, so that a
    missing-value indicator (added for a column the POOLED statistics find gaps in, the same
    columns at every party) widens every party's model alike; a flow that does not is refused."""
    spec = pp.PreprocessingSpec.from_dict(preprocessing)
    if spec.missing_indicator and not indicators:
        raise ValueError(
            f"{flow}: preprocessing.missing_indicator is not supported for rows split "
            "across parties; impute without it"
        )
    return spec


def _context(
    job_id: str,
    stage: int,
    session: str,
    parties: Sequence[str],
    threshold: int,
    dimension: int,
    **kw: Any,
) -> SumContext:
    job = channel_job(job_id)
    return SumContext(PROTOCOL, job, stage, session, tuple(parties), threshold, dimension, **kw)


def _training_matrix(
    ref: TableRef, job_id: str, features: list[str], holdout: Holdout
) -> np.ndarray:
    """The party's training rows (its held-out rows, if any, stay out as in training)."""
    frame = PartyStore.of(ref).read_table(ref, allow_missing=True)
    if callable(holdout):
        train = np.setdiff1d(np.arange(len(frame)), holdout(len(frame)))
    else:
        train = holdout_split(len(frame), holdout, job_id)[0]
    return frame.loc[:, features].to_numpy(dtype=float)[train]


@task(name="pre-party-input", task_run_name="{ref.party}: own column statistics", **PARTY_STEP)
def store_input(
    ref: TableRef,
    job_id: str,
    features: list[str],
    holdout: Holdout,
    edges: np.ndarray | None = None,
) -> None:
    """This party's vector for a sum: [count | sum | sum of squares] per column and its row
    count, or (given the public grid's ``edges``) its counts per bin, per column."""
    X = _training_matrix(ref, job_id, features, holdout)
    if edges is None:
        vector, name = wide(np.append(pp.moments(X), len(X))), "moments"
    else:
        vector, name = pp.histogram(X, edges), "histogram"
    ArtifactStore(PartyStore.of(ref)).put(_key(job_id, name), vector, "secure-sum-input")


@task(name="pre-coordinator-fit", task_run_name="coordinator: fit pooled statistics", **PARTY_STEP)
def fit_and_send(
    job_id: str,
    features: list[str],
    spec: pp.PreprocessingSpec,
    moments_sum: np.ndarray,
    histogram_sum: np.ndarray | None,
    edges: np.ndarray | None,
    parties: Sequence[str],
) -> dict[str, Any]:
    """Fit the pooled statistics, keep them in the coordinator's store, send every party."""
    total = narrow(np.asarray(moments_sum, dtype=float))
    rows = int(np.rint(total[-1]))
    fitted = pp.fit_pooled(total[:-1], features, rows, spec, histogram_sum, edges)
    gaps = [c for c in fitted.columns if c.missing and c.fill is None]
    if gaps:  # refused before any round, every column at once (pooled counts only)
        listed = "; ".join(f"column {c.name!r}: {c.missing} of {rows} rows" for c in gaps)
        raise pp.PreprocessingError(
            f"job {job_id}: missing (null/NaN) values over the parties in {len(gaps)} "
            f"column(s): {listed}. Set preprocessing.impute (mean, median or constant) in the "
            "job to fill them"
        )
    ArtifactStore(coordinator_store()).put(_key(job_id, "fitted"), fitted.to_dict(), "statistics")
    return send_fitted(job_id, parties)


def send_fitted(job_id: str, parties: Sequence[str]) -> dict[str, Any]:
    """(Re-)send the stored statistics (a resumed coordinator sends the same bytes)."""
    fitted = ArtifactStore(coordinator_store()).get(_key(job_id, "fitted"))
    endpoint = _endpoint(job_id, COORDINATOR)
    for party in parties:
        endpoint.send(party, PROTOCOL, fitted)
    return fitted


def stored_fitted(database: str, job_id: str) -> pp.FittedPreprocessing | None:
    """The statistics a holder (party or coordinator) kept for the job, if any."""
    data = ArtifactStore(PartyStore(database)).get(_key(job_id, "fitted"))
    return None if data is None else pp.FittedPreprocessing.from_dict(data)


@task(name="pre-party-keep", task_run_name="{ref.party}: keep pooled statistics", **PARTY_STEP)
def keep_fitted(
    ref: TableRef,
    job_id: str,
    features: list[str],
    spec: pp.PreprocessingSpec,
) -> dict[str, Any]:
    """Receive the coordinator's statistics, refuse them unless they are for this job's spec
    and columns, and keep them for training and scoring."""
    data = _endpoint(job_id, ref.party).receive(COORDINATOR, PROTOCOL)
    fitted = pp.FittedPreprocessing.from_dict(data)
    if fitted.spec != spec or fitted.input_names != list(features):
        raise PreprocessingRefusalError(
            f"{ref.party}: the coordinator's statistics of job {job_id} are for "
            f"{fitted.spec.to_dict()} on {fitted.input_names}, not the agreed "
            f"{spec.to_dict()} on {list(features)}"
        )
    ArtifactStore(PartyStore.of(ref)).put(_key(job_id, "fitted"), data, "statistics")
    return data


def sessions(
    job_id: str,
    features: list[str],
    spec: pp.PreprocessingSpec,
    parties: Sequence[str],
    threshold: int,
    stage_timeout: float,
    session_ids: Sequence[str | None],
) -> tuple[SumContext, SumContext | None]:
    """The secure-sum sessions of a job's statistics (the second only for quartiles), with the
    ids the coordinator announced; their dimensions need no data."""
    columns, options = len(features), {"stage_timeout": stage_timeout}
    moments = 2 * (3 * columns + 1)
    first = _context(job_id, 0, session_ids[0], parties, threshold, moments, **options)
    if not pp.needs_quartiles(spec):
        return first, None
    bins = columns * (pp.HISTOGRAM_BINS + 2)
    return first, _context(job_id, 1, session_ids[1], parties, threshold, bins, **options)


def input_key(job_id: str, ctx: SumContext) -> str:
    """Where a party stores the vector it contributes to session ``ctx``."""
    return _key(job_id, "moments" if ctx.round == 0 else "histogram")


# ---- party mode: the coordinator and each party in their own processes ------------------------
CALL = "preprocessing_call"
EDGES = "preprocessing_edges"


def coordinator_statistics(
    job_id: str,
    features: list[str],
    spec: pp.PreprocessingSpec,
    parties: Sequence[str],
    threshold: int,
    stage_timeout: float,
) -> dict[str, Any] | None:
    """The coordinator's side: announce the sessions (once; a restart re-sends the same call),
    drive them, send the grid between them, fit and send the statistics."""
    if not needs_statistics(spec):
        return None
    if ArtifactStore(coordinator_store()).get(_key(job_id, "fitted")) is not None:
        return send_fitted(job_id, parties)
    endpoint = _endpoint(job_id, COORDINATOR)
    call = endpoint.sent(parties[0], CALL)
    if call is None:
        fresh = [f"{job_id}/preprocessing-{stage}/{secrets.token_hex(8)}" for stage in (0, 1)]
        call = {
            "sessions": fresh if pp.needs_quartiles(spec) else [fresh[0], None],
            "spec": spec.to_dict(),
            "features": list(features),
            "threshold": threshold,
            "stage_timeout": stage_timeout,
        }
    for party in parties:
        endpoint.send(party, CALL, call)
    first, second = sessions(
        job_id, features, spec, parties, threshold, stage_timeout, call["sessions"]
    )

    def summed(ctx: SumContext) -> np.ndarray:
        secure_sum.unmask_sum(ctx, secure_sum.drive_session(ctx))
        return secure_sum.stored_sum(ctx)[0]

    moments_sum = summed(first)
    histogram_sum, edges = None, None
    if second is not None:
        total = narrow(np.asarray(moments_sum, dtype=float))[:-1]  # the public grid from it
        edges = pp.histogram_edges(pp.PooledMoments.from_sum(total, len(features)))
        for party in parties:
            endpoint.send(party, EDGES, edges)
        histogram_sum = summed(second)
    return fit_and_send(job_id, features, spec, moments_sum, histogram_sum, edges, parties)


def party_statistics(
    ref: TableRef,
    job_id: str,
    features: list[str],
    spec: pp.PreprocessingSpec,
    parties: Sequence[str],
    holdout: Holdout,
) -> dict[str, Any] | None:
    """A party's side: check the coordinator's call against its own spec and columns, add its
    vectors to the sessions, keep the fitted statistics (a restarted party that kept them
    already skips all of it)."""
    if not needs_statistics(spec):
        return None
    kept = ArtifactStore(PartyStore.of(ref)).get(_key(job_id, "fitted"))
    if kept is not None:
        return kept
    endpoint = _endpoint(job_id, ref.party)
    call = endpoint.receive(COORDINATOR, CALL)
    if call["spec"] != spec.to_dict() or list(call["features"]) != list(features):
        raise PreprocessingRefusalError(
            f"{ref.party}: the coordinator's call for the statistics of job {job_id} is for "
            f"{call['spec']} on {call['features']}, not the agreed {spec.to_dict()} on "
            f"{list(features)}"
        )
    threshold, timeout = int(call["threshold"]), float(call["stage_timeout"])
    first, second = sessions(job_id, features, spec, parties, threshold, timeout, call["sessions"])

    def take_part(ctx: SumContext, after: str) -> None:
        """Add the stored vector to ``ctx``; the coordinator's ``after`` message, once there,
        says the session went on without this party."""
        secure_sum.contribute(
            ref,
            ctx,
            lambda: secure_sum.mask_stored_input(ref, ctx, input_key(job_id, ctx)),
            lambda: secure_sum.coordinator_sent(endpoint, after),
        )

    store_input(ref, job_id, features, holdout)
    take_part(first, EDGES if second is not None else PROTOCOL)
    if second is not None:
        edges = np.asarray(endpoint.receive(COORDINATOR, EDGES), dtype=float)
        store_input(ref, job_id, features, holdout, edges)
        take_part(second, PROTOCOL)
    return keep_fitted(ref, job_id, features, spec)
