"""Horizontal logistic regression with secure aggregation, one task per party step.

The maths is in :mod:`core.horizontal_lr` (the model) and :mod:`core.secagg.multiround` (the
masking, keys agreed once per job), wired to the stores and the channel by
:mod:`tasks.secure_rounds`. This module adds what is horizontal-specific: checking tables, the
masked local update, the coordinator's model update, the parties' check of it and the round
checkpoints. Each side (a hospital, the coordinator; :mod:`flows.horizontal_lr`) opens only its
own store and channel endpoint; the coordinator is a logical party with its own store. A
side's whole round is one task run, and the side holds its database open through the rounds
(:func:`store_held`): a round's fixed cost is then its messages and a few commits, not
Prefect's or DuckDB's openings.

Across rounds (a coordinator unmasking one party by broadcasting the same model twice, then
claiming that party dropped): each party checks that the model it is sent is exactly the
previous model moved by the mean update sent along, and, if it helped unmask the round, that
this mean is the one of the sum it unmasked itself from its peers' messages, which the
coordinator relays with their senders' proofs (:func:`verified_model`); and it contributes
at one model in one round only (:func:`_mask`). What is left for an honest-but-curious
coordinator: two consecutive sums with senders S and S - {C} differ by C's weighted update plus
``sum over S - {C} of n_j (g_j(w_r) - g_j(w_r+1))``, at most ``N L |w_r+1 - w_r|`` with
``L <= max |(x, 1)|^2 / 4 + l2`` in gradient mode: not C's update while the model moves, an
approximation of it near convergence (and C's row count exactly). Only per-round noise would
hide that.

Tasks do not use Prefect's result cache (``NO_CACHE``): resuming is done by the parties' own
round checkpoints, so nothing a party computes is kept in the orchestrator's result storage.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from prefect import get_run_logger, task
from prefect.runtime import flow_run

from core import horizontal_lr as hlr
from core import test_switches
from core.model_format import ModelRecord
from core.preprocessing import FittedPreprocessing
from core.secagg.errors import InsufficientSurvivorsError, ProtocolViolationError
from core.secagg.weighted import packed_dimension, unpack_weighted
from federation.channel import PartyEndpoint
from federation.workspace import channel_for
from storage import models
from storage.artifacts import Artifact, ArtifactStore
from storage.checkpoints import RoundCheckpoints
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import secure_rounds, secure_sum
from tasks.policy import PARTY_STEP, is_transient
from tasks.preprocessing import stored_fitted
from tasks.reporting import job_name, provenance
from tasks.secure_sum import COORDINATOR, RoundStateError, coordinator_store
from tasks.summaries import current_attempt, holdout_split

PROTOCOL = "horizontal"


@dataclass(frozen=True)
class RoundContext:
    """What every step of one round agrees on (the job's secure-aggregation terms, the round,
    the stage deadline); small and non-secret, a task parameter. Build it with
    :func:`round_context`."""

    job: secure_rounds.RoundsJob
    round: int
    stage_timeout: float = 60.0

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def parties(self) -> tuple[str, ...]:
        return self.job.parties

    @property
    def n_features(self) -> int:
        """The model's columns (its intercept apart), as the job's packed dimension says."""
        return self.job.dimension - packed_dimension(1)

    @property
    def threshold(self) -> int:
        return self.job.threshold

    @property
    def workspace(self) -> str | None:
        return self.job.workspace

    def endpoint(self, party: str) -> PartyEndpoint:
        return self.job.endpoint(party)


def rounds_job(
    job_id: str,
    parties: tuple[str, ...] | list[str],
    threshold: int,
    n_features: int,
    workspace: str | None = None,
    stage_timeout: float = 60.0,
) -> secure_rounds.RoundsJob:
    """The job's secure-aggregation terms: packed vector = [rows * update (n_features + 1),
    rows * loss, rows]; keys agreed once for all its rounds."""
    dimension = packed_dimension(n_features + 1)
    return secure_rounds.RoundsJob(
        PROTOCOL,
        job_id,
        tuple(parties),
        threshold,
        dimension,
        workspace,
        stage_timeout=stage_timeout,
    )


def round_context(
    job_id: str,
    round_: int,
    parties: tuple[str, ...] | list[str],
    threshold: int,
    n_features: int,
    workspace: str | None = None,
    stage_timeout: float = 60.0,
) -> RoundContext:
    return RoundContext(
        rounds_job(job_id, parties, threshold, n_features, workspace, stage_timeout),
        round_,
        stage_timeout,
    )


@dataclass(frozen=True)
class TrainingOptions:
    local_epochs: int  # 0: average gradients (exactly centralised GD); k > 0: FedAvg
    learning_rate: float
    l2: float
    tol: float = 0.0  # stop once the largest weight change of a round is below this
    # this party's own choice, never sent: the share of its rows it keeps out of training
    # (split by tasks.summaries.holdout_split, seeded by the job id) and scores at the end
    holdout_fraction: float = 0.0


# ---------------------------------------------------------------------------------------------
# Keys and stores


def checkpoints(store: PartyStore, job_id: str) -> RoundCheckpoints:
    return RoundCheckpoints(store, PROTOCOL, job_id)


def model_key(job_id: str) -> str:
    return models.model_key(PROTOCOL, job_id)


def _schema_key(job_id: str) -> str:
    return f"{PROTOCOL}/{job_id}/schema"


def _weights_before(store: PartyStore, ctx: RoundContext, who: str) -> np.ndarray:
    """The model a round starts from: zeros, or this holder's own checkpoint of the last round."""
    if ctx.round == 0:
        return hlr.init_model(ctx.n_features)
    try:
        saved = checkpoints(store, ctx.job_id).load(ctx.round - 1)
    except KeyError:
        raise RoundStateError(f"{who}: no checkpoint of round {ctx.round - 1}") from None
    return np.asarray(saved["weights"], dtype=np.float64)


def model_point(weights: np.ndarray) -> str:
    """Digest of a model, naming the point at which a party computed its update."""
    return hashlib.sha256(np.ascontiguousarray(weights, dtype="<f8").tobytes()).hexdigest()


def model_record(
    job_id: str,
    features: list[str],
    weights: np.ndarray,
    rounds: int,
    preprocessing: dict[str, Any] | None = None,
    origin: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The saved model in the common format (``core.model_format``): ``weights`` is the
    training's vector, coefficients then the intercept. With ``preprocessing`` (the pooled
    statistics it was trained with) scoring applies them; ``origin`` is the holder's
    :func:`tasks.reporting.provenance` (its job and the digest of its table)."""
    weights = np.asarray(weights, dtype=np.float64)
    record = ModelRecord.linear(
        PROTOCOL,
        job_id,
        features,
        weights[:-1],
        float(weights[-1]),
        preprocessing=preprocessing,
        extras={"rounds": rounds},
        **(origin or {"job": job_name()}),
    )
    return record.to_dict()


def model_weights(model: dict[str, Any]) -> np.ndarray:
    """Weight vector (coefficients in ``model['features']`` order, then intercept)."""
    coefficients = [model["coefficients"][f] for f in model["features"]]
    return np.array([*coefficients, model["intercept"]], dtype=np.float64)


def predict_proba(model: dict[str, Any], X: pd.DataFrame | np.ndarray) -> np.ndarray:
    """P(label = 1) for rows of ``X`` (a DataFrame of raw values by column name, transformed
    with the model's preprocessing, or an array already in model order and units)."""
    if isinstance(X, pd.DataFrame):
        if model.get("preprocessing") is None:
            X = X.loc[:, model["features"]]
        else:
            fitted = FittedPreprocessing.from_dict(model["preprocessing"])
            X = fitted.transform(X.loc[:, fitted.input_names].to_numpy(float))
            X = X[:, [fitted.output_names.index(f) for f in model["features"]]]
    return hlr.predict_proba(model_weights(model), np.asarray(X, dtype=np.float64))


# ---------------------------------------------------------------------------------------------
# Before any round: each party checks its own table; the coordinator compares column names


@task(name="hlr-check-table", task_run_name="{ref.party}: check {ref.table}", **PARTY_STEP)
def check_table(ref: TableRef) -> str:
    """Validate the party's own table; return a salted digest of it (for the job id).

    The salt is the party's secret, so the digest only tells a later run "changed or not".
    """
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    with store.transaction() as con:
        found = con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [ref.table]
        ).fetchone()[0]
        if found and con.execute(f'SELECT count(*) FROM "{ref.table}"').fetchone()[0] == 0:
            raise hlr.EmptyPartyError(
                f"party {ref.party!r}: table {ref.table!r} has no rows", party=ref.party
            )
        salt = artifacts.get(f"{PROTOCOL}/fingerprint-salt", con=con)
        if salt is None:
            salt = secrets.token_bytes(32)
            artifacts.put(f"{PROTOCOL}/fingerprint-salt", salt, "secret", con=con)
    # validated against the descriptor; missing cells are imputed or refused before training
    frame = store.read_table(ref, allow_missing=True)
    label = ref.label_column or ""
    hlr.validate_party_tables({ref.party: frame}, label, ref.id_column, allow_missing=True)
    digest = hashlib.sha256(salt)
    digest.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    digest.update(",".join(map(str, frame.columns)).encode())
    return digest.hexdigest()


def _status(store: PartyStore, job_id: str) -> dict[str, Any]:
    """Last round this holder finished in the job, and that round's largest weight change."""
    cps = checkpoints(store, job_id)
    last = cps.last_round()
    change = cps.load(last).get("change") if last >= 0 else None
    return {"last_round": last, "change": change}


@task(name="hlr-join-job", task_run_name="{ref.party}: announce columns", **PARTY_STEP)
def join_job(ref: TableRef, job_id: str) -> dict[str, Any]:
    """Send the coordinator the label and feature column names (no rows, no row count).

    Returns the party's last finished round of this job, so a re-run can resume.
    """
    store = PartyStore.of(ref)
    frame = store.read_table(ref, allow_missing=True)  # imputed or refused before training
    label = ref.label_column or ""
    features = hlr.validate_party_tables({ref.party: frame}, label, ref.id_column, True)
    schema = {"label_column": ref.label_column, "feature_columns": features}
    channel_for(job_id).endpoint(ref.party).send(COORDINATOR, "schema", schema)
    return _status(store, job_id)


@task(name="hlr-open-job", task_run_name="coordinator: compare columns", **PARTY_STEP)
def open_job(
    parties: list[str],
    job_id: str,
    workspace: str | None,
    threshold: int,
    timeout: float,
) -> dict[str, Any]:
    """Refuse parties whose columns differ; send everyone the agreed feature order.

    Waits for every party's columns until one deadline, ``timeout`` from now; the parties
    that have not announced theirs by then are missing from the start (they may still join a
    later round), and fewer than ``threshold`` announcing fails naming the missing ones.
    Returns the agreed features, who announced, and the coordinator's last finished round.
    """
    endpoint = channel_for(job_id, workspace).endpoint(COORDINATOR)
    deadline = time.monotonic() + timeout
    schemas = secure_sum.collect(endpoint, "schema", parties, 0, deadline)
    missing = [p for p in parties if p not in schemas]
    if len(schemas) < threshold:
        raise InsufficientSurvivorsError(
            f"job {job_id}: only {sorted(schemas)} announced their columns within "
            f"{timeout:g} s, fewer than the threshold {threshold}; missing: {missing}"
        )
    if missing:
        get_run_logger().warning("job %s: %s did not announce columns", job_id, missing)
    announced = [p for p in parties if p in schemas]
    first, expected = announced[0], schemas[announced[0]]
    for party in announced[1:]:
        schema = schemas[party]
        if schema["label_column"] != expected["label_column"]:
            raise hlr.SchemaMismatchError(
                f"party {party!r}: label column {schema['label_column']!r} differs from party "
                f"{first!r}'s {expected['label_column']!r}",
                party=party,
                column=schema["label_column"],
            )
        missing = [c for c in expected["feature_columns"] if c not in schema["feature_columns"]]
        extra = [c for c in schema["feature_columns"] if c not in expected["feature_columns"]]
        if missing or extra:
            raise hlr.SchemaMismatchError(
                f"party {party!r}: feature columns differ from party {first!r}'s: "
                f"missing {missing}, extra {extra}",
                party=party,
                column=(missing + extra)[0],
            )
    store = coordinator_store(workspace)
    ArtifactStore(store).put(_schema_key(job_id), expected, "schema")
    for party in parties:
        endpoint.send(party, "schema_agreed", expected)
    features = list(expected["feature_columns"])
    return {"features": features, "announced": announced, **_status(store, job_id)}


def _agreed_features(endpoint: PartyEndpoint) -> list[str]:
    return list(endpoint.receive(COORDINATOR, "schema_agreed")["feature_columns"])


def agreed_features(ref: TableRef, job_id: str) -> list[str]:
    """Party mode: the feature order the coordinator agreed (after :func:`join_job`)."""
    return _agreed_features(channel_for(job_id).endpoint(ref.party))


# ---------------------------------------------------------------------------------------------
# One round, party side (plain steps: the party's rounds task calls them)

_ROWS: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
_ROWS_LOCK = threading.Lock()


def _training_rows(
    ref: TableRef, store: PartyStore, job_id: str, features: list[str], holdout: float
) -> tuple[np.ndarray, np.ndarray]:
    """The party's training rows (scaled, hold-out removed), read once per flow run.

    Why: reading and validating the table from DuckDB every round cost more than the round's
    own work; within a run the protocol takes the table as fixed (its digest named the job).
    The copy lives in the party's own process and is keyed by the flow run."""
    run = flow_run.get_id()
    key = (run, ref.database, ref.table, job_id, tuple(features), holdout)
    with _ROWS_LOCK:
        cached = _ROWS.get(key) if run else None
    if cached is not None:
        return cached
    fitted = stored_fitted(ref.database, job_id)  # the pooled statistics, if the job has any
    frame = store.read_table(ref, allow_missing=fitted is not None)
    X, y = hlr.party_arrays(frame, features, ref.label_column or "")
    if fitted is not None:
        X = fitted.transform(X, f"party {ref.party}, table {ref.table!r}")
    train = holdout_split(len(y), holdout, job_id)[0]
    rows = (X[train], y[train])  # held-out rows never reach an update
    if run:
        with _ROWS_LOCK:
            _ROWS.clear() if len(_ROWS) > 8 else None
            _ROWS[key] = rows
    return rows


def _features(endpoint: PartyEndpoint) -> list[str]:
    """The agreed feature order (received once per process and job)."""
    key = (str(endpoint.channel.folder), endpoint.party)
    found = _FEATURES.get(key)
    if found is None:
        found = _FEATURES[key] = _agreed_features(endpoint)
    return list(found)


_FEATURES: dict[tuple[str, str], list[str]] = {}


def trained_columns(fitted: FittedPreprocessing | None, features: list[str]) -> list[str]:
    """The model's columns: the agreed ``features``, then a ``<name>_missing`` indicator for
    each column the job's pooled statistics flag (``missing_indicator``); the same at every
    holder, since all keep the same statistics."""
    return list(features) if fitted is None else fitted.output_names


def model_width(database: str, job_id: str, features: list[str]) -> int:
    """How many columns the job's model has at a holder of its pooled statistics (read from
    its store once per round context built, before the first round)."""
    return len(trained_columns(stored_fitted(database, job_id), features))


def coordinator_width(job_id: str, features: list[str], workspace: str | None) -> int:
    """:func:`model_width` at the coordinator (its store in the workspace)."""
    return model_width(str(coordinator_store(workspace).path), job_id, features)


def _mask(
    ref: TableRef, store: PartyStore, ctx: RoundContext, call: RoundCall, options: TrainingOptions
) -> tuple[np.ndarray, dict[str, Any]]:
    """Compute the local update at the round's model and send it masked (once a round);
    returns that model and the party's stored record.

    The packed vector is ``[rows * update, rows * loss, rows]`` (FedAvg weights by rows), so
    the coordinator learns only the weighted means and the total row count. A party
    contributes at one model in one round only: two sums at one model whose senders differ
    by one party give that party's update, and a coordinator could get them across rounds.
    """
    features = _features(ctx.endpoint(ref.party))
    with store.session():  # one opening of the database for the reads and the stored state
        weights = _weights_before(store, ctx, ref.party)
        X, y = _training_rows(ref, store, ctx.job_id, features, options.holdout_fraction)
        if options.local_epochs == 0:
            update = hlr.local_gradient(weights, X, y, options.l2)
        else:
            update = hlr.local_epochs(
                weights, X, y, options.l2, options.learning_rate, options.local_epochs
            )
        point_key = f"{PROTOCOL}/{ctx.job_id}/point/{model_point(weights)}"

        def one_round_per_model(con: Any) -> list[Artifact]:
            seen = ArtifactStore(store).get(point_key, con=con)
            if seen is not None and seen != ctx.round:
                raise ProtocolViolationError(
                    f"party {ref.party!r}: the coordinator asks for round {ctx.round} of job "
                    f"{ctx.job_id} at the same model as round {seen}; refusing to contribute "
                    "twice at one model (the difference of two such sums would reveal single "
                    "updates)"
                )
            return [Artifact(point_key, ctx.round, "secagg-point")]  # stored with the mask

        start = secure_rounds.round_start(ctx.job, ctx.round, call.protocol, ref.party)
        record = secure_rounds.party_mask(
            store, ctx.job, ref.party, start, update.packed(), one_round_per_model
        )
    return weights, record


def _answer(
    ref: TableRef, store: PartyStore, ctx: RoundContext, record: dict[str, Any]
) -> dict[str, Any]:
    """Answer the coordinator's unmask request of the round (once); returns the party's new
    record (what its masking stored, moved on), stored with the round's checkpoint
    (:func:`tasks.secure_rounds.party_answer` says why)."""
    endpoint = ctx.endpoint(ref.party)
    request = endpoint.receive(COORDINATOR, secure_rounds.REQUEST, round=ctx.round)
    return secure_rounds.party_answer(store, ctx.job, ref.party, ctx.round, request, record)


@task(name="hlr-join-rounds", task_run_name="{ref.party}: job keys", **PARTY_STEP)
def join_rounds(ref: TableRef, ctx: RoundContext) -> None:
    """Once per job: this party's key pair; the public key to the coordinator, sent with the
    first round it joins. ``ctx`` is built from this party's own options: its terms (parties,
    threshold, stage timeout) are held, and a coordinator's call that states others is
    refused (:func:`tasks.secure_rounds.party_state`)."""
    secure_rounds.party_join(PartyStore.of(ref), ctx.job, ref.party, ctx.round, agreed=True)


def verified_model(
    message: dict[str, Any],
    before: np.ndarray,
    options: TrainingOptions,
    who: str,
    round_: int,
    own_sum: np.ndarray | None = None,
) -> np.ndarray:
    """The broadcast weights, if they are exactly the update of ``before`` by the mean update.

    Why: a party must not compute its next update at whatever model the coordinator names.
    With this check the model of round r+1 is the model of round r moved by the mean update
    the coordinator says it unmasked; together with the one-model-one-round rule of
    :func:`_mask`, the coordinator cannot have two rounds summed at the same model (whose
    difference, with one party claimed dropped, is that party's update). ``own_sum`` is the
    round's sum as this party unmasked it itself (:func:`tasks.secure_rounds.party_sum`; None
    if it did not help unmask): the mean update must be exactly that sum's, so the
    coordinator cannot make one up.
    """
    where = f"{who}: coordinator's model of round {round_}"
    mean = np.asarray(message.get("mean_update", ()), dtype=np.float64)
    weights = np.asarray(message["weights"], dtype=np.float64)
    if mean.shape != before.shape or not np.all(np.isfinite(mean)):
        raise ProtocolViolationError(
            f"{where} carries no usable mean update (shape {mean.shape}, expected {before.shape})"
        )
    if own_sum is not None and not np.array_equal(mean, unpack_weighted(own_sum).mean):
        raise ProtocolViolationError(
            f"{where}: its mean update is not the one of the sum {who} unmasked from its peers' "
            "messages; refusing it (a made-up update could unmask one party across rounds)"
        )
    expected = hlr.next_model(before, mean, options.local_epochs, options.learning_rate)
    if weights.shape != expected.shape or not np.array_equal(weights, expected):
        raise ProtocolViolationError(
            f"{where} is not the update of round {round_ - 1}'s model by the mean it sent; "
            "refusing it (a coordinator choosing the model could unmask one party across rounds)"
        )
    return weights


def _finish(
    ref: TableRef,
    store: PartyStore,
    ctx: RoundContext,
    call: RoundCall,
    options: TrainingOptions,
    known: tuple[np.ndarray, dict[str, Any]] | None = None,
) -> None:
    """Receive the round's model, verify it (against the sum this party unmasked itself, if
    it helped), and checkpoint the round (the model is kept after the stop,
    :func:`keep_model`). ``known``: the round's model before and this party's record, as its
    own earlier steps of the round left them (else read from its store)."""
    endpoint = ctx.endpoint(ref.party)
    message = endpoint.receive(COORDINATOR, "model", round=ctx.round)
    if message["round"] != ctx.round:
        raise RoundStateError(f"{ref.party}: the model message of round {ctx.round} is another's")
    if known is None:
        with store.session():
            before = _weights_before(store, ctx, ref.party)
            record = secure_rounds.load_record(store, ctx.job, ref.party)
    else:
        before, record = known
    own_sum = secure_rounds.party_sum(
        ctx.job,
        ref.party,
        record,
        call.protocol,
        ctx.round,
        message.get("revealers"),
        ctx.stage_timeout,
    )
    weights = verified_model(message, before, options, ref.party, ctx.round, own_sum)
    cps = checkpoints(store, ctx.job_id)
    with store.transaction() as con:
        state = {"weights": weights, "change": message["change"]}
        if known is not None:  # the round's answer, stored with its checkpoint
            also = [cps.item(ctx.round, state)]
            secure_rounds.save_record(store, ctx.job, ref.party, record, con, also=also)
        else:
            cps.save(ctx.round, state, con=con)


# ---------------------------------------------------------------------------------------------
# One round, coordinator side (relaying and unmasking are tasks.secure_sum's steps)


def _agreed_schema(artifacts: ArtifactStore, job_id: str, con: Any = None) -> dict[str, Any]:
    schema = artifacts.get(_schema_key(job_id), con=con)
    if schema is None:
        raise RoundStateError(f"coordinator: no agreed schema for job {job_id}")
    return schema


def _commit_round(
    ctx: RoundContext,
    options: TrainingOptions,
    started: float,
    responders: list[str] | None,
    faults: secure_sum.Faults = secure_sum.NO_FAULTS,
) -> dict[str, Any]:
    """Unmask the round's sum, update the model, checkpoint, broadcast (coordinator).

    Only the weighted mean update, the mean loss and the total row count are ever in the
    clear here; they go to the parties with the new model, which each party recomputes from
    them (:func:`verified_model`). The unmasking's new state and the checkpoint are one
    transaction, the round's commit; a retry after it only re-sends. (``faults``, tests only:
    a crash after the commit, before the model is sent.)
    """
    store, endpoint = coordinator_store(ctx.workspace), ctx.endpoint(COORDINATOR)
    cps = checkpoints(store, ctx.job_id)
    with store.session():
        saved = cps.find(ctx.round)  # committed before a retry: only re-send
        if saved is None:
            answered = list(responders if responders is not None else ctx.parties)
            responses = secure_sum.collect(endpoint, secure_rounds.RESPONSE, answered, ctx.round, 0)
            previous = cps.load(ctx.round - 1) if ctx.round > 0 else None
            with store.transaction() as con:
                summed = secure_rounds.coordinator_unmask(store, ctx.job, ctx.round, responses, con)
                mean = unpack_weighted(summed.total)
                if previous is None:
                    before, history = hlr.init_model(ctx.n_features), []
                else:
                    before, history = np.asarray(previous["weights"]), previous["history"]
                weights = hlr.next_model(
                    before, mean.mean, options.local_epochs, options.learning_rate
                )
                entry = {
                    "round": ctx.round,
                    "loss": mean.mean_loss,
                    "seconds": round(time.time() - started, 3),
                    "started_at": started,  # the round's period is from one start to the next
                    "survivors": summed.senders,
                    "change": float(np.max(np.abs(weights - before))),
                    "attempt": current_attempt(),  # the rounds table says who ran the round
                }
                saved = {
                    "weights": weights,
                    "mean_update": mean.mean,
                    "change": entry["change"],
                    "history": [*history, entry],
                    "revealers": summed.responders,
                }
                secure_rounds.save_record(
                    store,
                    ctx.job,
                    COORDINATOR,
                    summed.record,
                    con,
                    also=[cps.item(ctx.round, saved)],
                )
            secure_rounds.remember(store, ctx.job, summed.record)
            _logger().info(
                "round %d: loss %.6f from %d parties", ctx.round, entry["loss"], len(summed.senders)
            )
            faults.crash_point(ctx.round, "commit")
    message = {
        "round": ctx.round,
        "weights": saved["weights"],
        "mean_update": saved["mean_update"],
        "survivors": saved["history"][-1]["survivors"],
        "revealers": saved.get("revealers"),
        "change": saved["change"],
    }
    secure_rounds.coordinator_relay_answers(
        ctx.job, ctx.round, message["survivors"], message["revealers"] or []
    )
    endpoint.send_many(ctx.parties, "model", message, round=ctx.round)
    return saved["history"][-1]


@task(
    name="hlr-resend-model",
    task_run_name="round {ctx.round}: coordinator re-sends the model",
    **PARTY_STEP,
)
def resend_model(ctx: RoundContext, options: TrainingOptions) -> dict[str, Any]:
    """A restarted coordinator: the committed round's result again (a party may not have
    it yet)."""
    return _commit_round(ctx, options, time.time(), None)


def _collect(ctx: RoundContext, answered: list[str]) -> list[str]:
    store, endpoint = coordinator_store(ctx.workspace), ctx.endpoint(COORDINATOR)
    inputs = secure_sum.collect(endpoint, secure_rounds.MASKED, answered, ctx.round, 0)
    with store.session():
        senders, _ = secure_rounds.coordinator_collect(store, ctx.job, ctx.round, inputs)
    return senders


@task(name="hlr-admit-keys", task_run_name="coordinator: job keys", **PARTY_STEP)
def admit_keys(
    job: secure_rounds.RoundsJob, round_: int, parties: list[str], timeout: float
) -> list[str]:
    """Once per job (and after a finished job is continued): the parties' public keys, sent
    with ``round_`` as the first round they join. Waits for the parties the coordinator has
    no keys of until one deadline; returns the parties in the session."""
    store, endpoint = coordinator_store(job.workspace), job.endpoint(COORDINATOR)
    with store.session():
        state = secure_rounds.coordinator_admit(store, job, {})
    wanted = [p for p in parties if p not in state.keys]
    if wanted:
        deadline = time.monotonic() + timeout
        found = secure_sum.collect(endpoint, secure_rounds.JOB_KEYS, wanted, round_, deadline)
        missing = [p for p in wanted if p not in found]
        if missing:
            _logger().warning(
                "job %s: %s sent no keys within %g s; left out until they ask to rejoin",
                job.job_id,
                missing,
                timeout,
            )
        with store.session():
            state = secure_rounds.coordinator_admit(store, job, found)
    return list(state.active)


def _logger() -> Any:
    return secure_sum._logger()


@task(name="hlr-coordinator-model", task_run_name="coordinator: store model", **PARTY_STEP)
def coordinator_model(job_id: str, workspace: str | None = None) -> dict[str, Any]:
    """Save the final model in the coordinator's store; return it with the round history."""
    store = coordinator_store(workspace)
    artifacts, cps = ArtifactStore(store), checkpoints(store, job_id)
    last = cps.last_round()
    saved = cps.load(last)
    fitted = stored_fitted(str(store.path), job_id)
    features = trained_columns(fitted, _agreed_schema(artifacts, job_id)["feature_columns"])
    model = model_record(job_id, features, saved["weights"], last + 1, fitted and fitted.to_dict())
    artifacts.put(model_key(job_id), model, "model")
    cps.prune(keep_last=2)
    return {**model, "weights": model_weights(model).tolist(), "history": saved["history"]}


# ---------------------------------------------------------------------------------------------
# The round's call, and party mode: each holder is its own process (a hospital's task run
# covers a group of rounds, the coordinator's one round)


@dataclass(frozen=True)
class RoundCall:
    """The coordinator's call for one round (or the stop after the last): what every holder
    must agree on before it contributes, and the round's active parties with their public
    keys. Sent once per round and never changed (a restarted coordinator re-sends it)."""

    stop: bool  # training is over, keep the last model
    parties: tuple[str, ...]
    threshold: int
    stage_timeout: float
    options: TrainingOptions
    # dropped in an earlier round and not yet back with new keys: not waited for in this
    # round; each asks to rejoin (:func:`tasks.secure_rounds.party_rejoin`)
    out: tuple[str, ...] = ()
    protocol: dict[str, Any] | None = None  # active parties and their keys (secure_rounds)

    def to_message(self) -> dict[str, Any]:
        return {
            "stop": self.stop,
            "parties": list(self.parties),
            "threshold": self.threshold,
            "stage_timeout": self.stage_timeout,
            "out": list(self.out),
            "options": [
                self.options.local_epochs,
                self.options.learning_rate,
                self.options.l2,
                self.options.tol,
            ],
            "protocol": self.protocol or {"active": [], "keys": {}},
        }

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> RoundCall:
        epochs, rate, l2, tol = message["options"]
        return cls(
            bool(message["stop"]),
            tuple(message["parties"]),
            int(message["threshold"]),
            float(message["stage_timeout"]),
            TrainingOptions(int(epochs), float(rate), float(l2), float(tol)),
            tuple(message.get("out", ())),
            message.get("protocol"),
        )


def _call_round(ctx: RoundContext, options: TrainingOptions, stop: bool = False) -> RoundCall:
    """Send every party the round's call (or the stop); a call already sent is re-sent as it
    was. Before calling, the coordinator admits the left-out parties that asked to rejoin
    (with new keys) on the previous round's call."""
    store, endpoint = coordinator_store(ctx.workspace), ctx.endpoint(COORDINATOR)
    parties = list(ctx.parties)
    already = endpoint.sent(parties[0], "round", round=ctx.round)
    if already is None:
        state = secure_rounds.coordinator_view(store, ctx.job)
        out = [p for p in parties if p not in state.active]
        if out and ctx.round > 0:
            back = secure_sum.collect(endpoint, secure_rounds.REJOIN, out, ctx.round - 1, 0, None)
            if back:
                _logger().info(
                    "job %s: %s asked to rejoin with new keys; called again from round %d",
                    ctx.job_id,
                    sorted(back),
                    ctx.round,
                )
                with store.session():
                    state = secure_rounds.coordinator_admit(store, ctx.job, back)
        out = [p for p in parties if p not in state.active]
        call = RoundCall(
            stop,
            tuple(parties),
            ctx.threshold,
            ctx.stage_timeout,
            options,
            tuple(out),
            secure_rounds.call_keys(state),
        )
        already = call.to_message()
    endpoint.send_many(parties, "round", already, round=ctx.round)
    return RoundCall.from_message(already)


def _checked_call(
    ref: TableRef, job_id: str, round_: int, parties: list[str], options: TrainingOptions
) -> RoundCall:
    """The coordinator's call for ``round_``, if it names the parties this party agreed to and
    its own training options (a coordinator changing the learning rate or the peers is
    refused, naming what differs)."""
    endpoint = channel_for(job_id).endpoint(ref.party)
    call = RoundCall.from_message(endpoint.receive(COORDINATOR, "round", round=round_))
    where = f"{ref.party}: the coordinator's call for round {round_} of job {job_id}"
    if sorted(call.parties) != sorted(parties):
        raise ProtocolViolationError(f"{where} names parties {list(call.parties)}, not {parties}")
    if (call.options.local_epochs, call.options.learning_rate, call.options.l2) != (
        options.local_epochs,
        options.learning_rate,
        options.l2,
    ):
        raise ProtocolViolationError(
            f"{where} asks for options {call.options}, not the agreed {options}"
        )
    return call


def _wait_for_request(ctx: RoundContext, party: str) -> bool:
    """Wait for the round's unmask request; False once the round's model came without one
    (this party was counted as dropped). Waits in the channel's receive, asking about the
    model once a second, up to the channel's receive timeout."""
    endpoint = ctx.endpoint(party)
    deadline = time.monotonic() + endpoint.channel.timeout
    while True:
        step = min(deadline, time.monotonic() + 1.0)
        if secure_sum.collect(
            endpoint, secure_rounds.REQUEST, [COORDINATOR], ctx.round, step, None
        ):
            return True
        if secure_sum.collect(endpoint, "model", [COORDINATOR], ctx.round, 0, None):
            return False
        if time.monotonic() >= deadline:
            endpoint.receive(COORDINATOR, secure_rounds.REQUEST, round=ctx.round, timeout=0)


ROUND_GROUP_SECONDS = 5.0
"""A hospital's task run goes on to its next round until it has run this long (party mode)."""


@dataclass(frozen=True)
class RoundsRun:
    """What one task run of a hospital's rounds did: the round it stopped before, and whether
    that is because the coordinator called the stop."""

    next_round: int
    stopped: bool


def _retried(task: Any, task_run: Any, state: Any) -> bool:
    """A hospital's rounds retry transient faults (:func:`tasks.policy.is_transient`), but not
    an injected crash (tests), which stands for this process's death."""
    try:
        state.result()
    except secure_sum.SimulatedCrashError:
        return False
    except Exception:
        pass
    return is_transient(task, task_run, state)


@task(
    name="hlr-party-rounds",
    task_run_name="rounds from {first}: {ref.party}",
    **{**PARTY_STEP, "retry_condition_fn": _retried},
)
def party_rounds(
    ref: TableRef,
    job_id: str,
    first: int,
    parties: list[str],
    width: int,
    options: TrainingOptions,
    fault: test_switches.PartyFault | None = None,
    faults: secure_sum.Faults = secure_sum.NO_FAULTS,
    group_seconds: float = ROUND_GROUP_SECONDS,
) -> RoundsRun:
    """This hospital's rounds from ``first`` as one task run, until the coordinator's stop or
    until the run has lasted ``group_seconds`` (a round that takes longer is a task run of
    its own). ``width``: the model's columns (:func:`model_width`, read once per job). A retry
    (a message that failed to go out, say) goes on after the last round this hospital saved,
    re-sending what it stored: nothing is masked twice. Tests only: ``fault`` fails this side
    before a stage, ``faults`` replaces a stage's step by one that fails or hangs.

    Why a group: a task run cost the Prefect API 28 ms of CPU here under load (its states,
    events and log line), and ten hospitals each running one a round made the API the largest
    cost of a fast round. Per-round detail stays where a person reads it: the coordinator's
    task run per round and its rounds table, and this run's log, which names the rounds it
    ran. Each round still commits its own checkpoint before the next begins, so a killed or
    failed run resumes at the round it was in, as before."""
    started = time.monotonic()
    first = max(first, checkpoints(PartyStore.of(ref), job_id).last_round() + 1)
    round_ = first
    try:
        while True:
            if not _party_round(ref, job_id, round_, parties, width, options, fault, faults):
                return RoundsRun(round_, stopped=True)
            round_ += 1
            if time.monotonic() - started >= group_seconds:
                return RoundsRun(round_, stopped=False)
    finally:
        if round_ > first:
            _logger().info(
                "%s: rounds %d-%d masked, answered, model checked and saved",
                ref.party,
                first,
                round_ - 1,
            )


def _party_round(
    ref: TableRef,
    job_id: str,
    round_: int,
    parties: list[str],
    width: int,
    options: TrainingOptions,
    fault: test_switches.PartyFault | None = None,
    faults: secure_sum.Faults = secure_sum.NO_FAULTS,
) -> bool:
    """This hospital's whole round; False on the coordinator's stop.

    It takes the call, masks its update (unless the call leaves it out: it then re-keys and
    asks to rejoin), answers the unmask request, then checks and saves the round's model.
    A round it already masked (a restarted process) is re-sent from its records; a round
    whose model is already out (it missed it) is only checked and saved.
    """
    call = _checked_call(ref, job_id, round_, parties, options)
    if call.stop:
        return False
    endpoint = channel_for(job_id).endpoint(ref.party)
    ctx = round_context(
        job_id, round_, call.parties, call.threshold, width, None, call.stage_timeout
    )
    store = PartyStore.of(ref)
    model_out = bool(secure_sum.collect(endpoint, "model", [COORDINATOR], round_, 0, None))
    if ref.party in call.out:
        with store.session():
            secure_rounds.party_rejoin(store, ctx.job, ref.party, round_)
    elif not model_out and not _stage_fault(faults, ctx, ref.party, "mask_input", fault):
        before, record = _mask(ref, store, ctx, call, options)
        wait = ctx.stage_timeout
        secure_rounds.prefetch(ctx.job, ref.party, secure_rounds.MASKED_RELAY, round_, wait)
        if _wait_for_request(ctx, ref.party):
            if not _stage_fault(faults, ctx, ref.party, "reveal_shares", fault):
                record = _answer(ref, store, ctx, record)  # stored with the checkpoint below
                wait = ctx.stage_timeout
                secure_rounds.prefetch(
                    ctx.job, ref.party, secure_rounds.RESPONSE_RELAY, round_, wait
                )
            _finish(ref, store, ctx, call, options, (before, record))
            return True
    _finish(ref, store, ctx, call, options)
    return True


def _stage_fault(
    faults: secure_sum.Faults,
    ctx: RoundContext,
    party: str,
    stage: str,
    fault: test_switches.PartyFault | None,
) -> bool:
    """Tests only: this side fails before ``stage`` (``fault``), or its step of the stage
    fails or hangs and it sends nothing then (``faults``: True), as a dropped hospital."""
    secure_sum.party_fault(fault, ctx.round, stage)
    return secure_sum.step_fault(faults, party, ctx.round, stage, ctx.stage_timeout)


@task(
    name="hlr-coordinator-round",
    task_run_name="round {ctx.round}: coordinator",
    cache_policy=PARTY_STEP["cache_policy"],
)
def coordinator_round(
    ctx: RoundContext, options: TrainingOptions, faults: secure_sum.Faults = secure_sum.NO_FAULTS
) -> dict[str, Any]:
    """The coordinator's whole round as one task run.

    It calls the round (admitting parties back that asked with new keys), waits for the
    active parties' masked inputs until one deadline, asks the senders to unmask, waits for
    their answers until a second deadline, and commits and broadcasts the model. A party
    that has not answered a stage by its deadline has dropped; below ``threshold`` the round
    aborts naming each missing party and why, before anything is unmasked. Returns the
    round's history entry, who was left out and who answered the unmasking. (``faults``,
    tests only: ``PRIVREG_TEST_CRASH_AFTER`` stops the coordinator after a stage or its commit,
    as if its process were killed.)
    """
    started = time.time()
    call = _call_round(ctx, options)
    active = list(call.protocol["active"]) if call.protocol else []
    gone = {p: "left out until it asks to rejoin with new keys" for p in call.out}
    senders = _await_stage(ctx, "mask_input", secure_rounds.MASKED, active, gone)
    faults.crash_point(ctx.round, "mask_input")
    senders = _collect(ctx, senders)
    responders = _await_stage(ctx, "reveal_shares", secure_rounds.RESPONSE, senders, gone)
    faults.crash_point(ctx.round, "reveal_shares")
    entry = _commit_round(ctx, options, started, responders, faults)
    return {"entry": entry, "left_out": list(call.out), "responders": responders}


def _await_stage(
    ctx: RoundContext, stage: str, kind: str, live: list[str], gone: dict[str, str]
) -> list[str]:
    """Those of ``live`` whose ``kind`` message arrived by the stage's deadline; the others
    are added to ``gone``; fewer than the threshold abort the round."""
    deadline = time.monotonic() + ctx.stage_timeout
    found = secure_sum.collect(ctx.endpoint(COORDINATOR), kind, live, ctx.round, deadline)
    late = f"no answer within {ctx.stage_timeout:g} s"
    for party in live:
        if party not in found:
            gone[party] = late
            _logger().warning(
                "round %d of job %s: %s dropped out at %s (%s)",
                ctx.round,
                ctx.job_id,
                party,
                stage,
                late,
            )
    answered = [p for p in live if p in found]
    secure_rounds.require_senders(ctx.job, ctx.round, stage, answered, gone)
    return answered


@contextmanager
def store_held(store: PartyStore) -> Iterator[None]:
    """Party mode: keep this process's database open through the training rounds.

    Why: opening a DuckDB database (and checkpointing it on close) cost 0.5 s and more here
    under load, several times a round's own work; with it held, a step's read costs a few
    milliseconds and a commit tens. Each step still commits its own transaction before it
    sends (a kill -9 loses nothing committed). The price: DuckDB lets one process write a
    file at a time, so another process wanting this party's database (the CLI, another job
    of the same party) waits until the rounds end."""
    with store.session():
        yield


def refuse_if_stopped(job_id: str, round_: int, parties: list[str], workspace: str | None) -> None:
    """A job whose hospitals were told to stop before ``round_`` cannot be called again: the
    stop is that round's call, sent once and never changed, so a hospital would stop again."""
    call = channel_for(job_id, workspace).endpoint(COORDINATOR).sent(parties[0], "round", round_)
    if call is not None and call["stop"]:
        raise ValueError(
            f"job {job_id} ended after {round_} rounds (its hospitals were told to stop); "
            "to train longer, start a new job (another job id or seed)"
        )


def stop_parties(ctx: RoundContext, options: TrainingOptions) -> None:
    """Party mode, after the last round: the stop, then shred the coordinator's secrets."""
    _call_round(ctx, options, stop=True)
    secure_rounds.forget_job(coordinator_store(ctx.workspace), ctx.job)


def forget_rounds(ref: TableRef, job_id: str, parties: list[str]) -> None:
    """Party mode, after the stop: shred this party's secure-aggregation secrets of the job."""
    job = secure_rounds.RoundsJob(PROTOCOL, job_id, tuple(parties), 0, 0)
    secure_rounds.forget_job(PartyStore.of(ref), job)


def _model_rows(
    ref: TableRef, store: PartyStore, job_id: str, holdout: float
) -> tuple[list[object], list[object]]:
    """The ids this party's copy of the model trained on and held out (the job's seeded
    split), saved with it so scoring's ``in_training`` column says which rows it saw."""
    ids = store.read_table(ref, allow_missing=True)[ref.id_column].to_numpy(dtype=object)
    train, held_out = holdout_split(len(ids), holdout, job_id)
    return ids[train].tolist(), ids[held_out].tolist()


@task(name="hlr-keep-model", task_run_name="{ref.party}: keep the model", **PARTY_STEP)
def keep_model(ref: TableRef, job_id: str, holdout: float = 0.0) -> dict[str, Any]:
    """After the coordinator's stop: this party's own copy of the last verified model, with
    the ids it trained on and held out (``holdout``: this party's own fraction)."""
    store = PartyStore.of(ref)
    cps = checkpoints(store, job_id)
    last = cps.last_round()
    if last < 0:
        raise RoundStateError(f"{ref.party}: job {job_id} stopped before any round finished")
    saved = cps.load(last)
    fitted = stored_fitted(ref.database, job_id)
    features = trained_columns(fitted, _agreed_features(channel_for(job_id).endpoint(ref.party)))
    model = model_record(
        job_id, features, saved["weights"], last + 1, fitted and fitted.to_dict(), provenance(ref)
    )
    rows = _model_rows(ref, store, job_id, holdout)
    models.ModelStore(store).save(model_key(job_id), ModelRecord.from_dict(model), *rows)
    cps.prune(keep_last=2)
    return {**model, "weights": model_weights(model).tolist()}
