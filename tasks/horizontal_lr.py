"""Horizontal logistic regression with secure aggregation, one task per party step.

The maths is in :mod:`core.horizontal_lr` (the model) and :mod:`core.secagg` (the masking);
the secure-aggregation steps and their driver (``run_session``) are the shared ones of
:mod:`tasks.secure_sum`. This module adds what is horizontal-specific: checking tables, the
masked local update, the coordinator's model update, the parties' check of it and the round
checkpoints. Each party task opens only that party's store and channel
endpoint; the coordinator is a logical party with its own store.

Across rounds (a coordinator unmasking one party by broadcasting the same model twice, then
claiming that party dropped): each party checks that the model it is sent is exactly the
previous model moved by the mean update sent along, and, if it helped unmask the round, that
this mean is the one of the sum it unmasked itself from its peers' direct copies
(:func:`verified_model`); and it contributes at one model in one round only (``point`` of
:func:`tasks.secure_sum.party_mask`). What is left for an honest-but-curious coordinator: two
consecutive sums with senders S and S - {C} differ by C's weighted update plus
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
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from prefect import get_run_logger, task

from core import horizontal_lr as hlr
from core.preprocessing import FittedPreprocessing
from core.secagg.errors import InsufficientSurvivorsError, ProtocolViolationError
from core.secagg.weighted import packed_dimension, unpack_weighted
from storage.artifacts import ArtifactStore
from storage.channel import PartyEndpoint
from storage.checkpoints import RoundCheckpoints
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.workspace import channel_for
from tasks import secure_sum
from tasks.policy import PARTY_STEP
from tasks.preprocessing import stored_fitted
from tasks.secure_sum import COORDINATOR, RoundStateError, SumContext, coordinator_store
from tasks.summaries import holdout_split

PROTOCOL = "horizontal"

RoundContext = SumContext
"""What every step of one round agrees on (job, round, fresh session id, parties, threshold,
packed dimension); small and non-secret, a task parameter. Build it with :func:`round_context`."""


def round_context(
    job_id: str,
    round_: int,
    session_id: str,
    parties: tuple[str, ...],
    threshold: int,
    n_features: int,
    workspace: str | None = None,
    stage_timeout: float = 60.0,
) -> SumContext:
    """The session of one round: packed vector = [rows * update (n_features + 1), rows * loss,
    rows]."""
    dimension = packed_dimension(n_features + 1)
    return SumContext(
        PROTOCOL,
        job_id,
        round_,
        session_id,
        tuple(parties),
        threshold,
        dimension,
        workspace,
        stage_timeout=stage_timeout,
        peer_copies=True,  # every sender checks the mean update the coordinator announces
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
    return f"{PROTOCOL}/{job_id}/model"


def _schema_key(job_id: str) -> str:
    return f"{PROTOCOL}/{job_id}/schema"


def _weights_before(store: PartyStore, ctx: RoundContext, n_features: int, who: str) -> np.ndarray:
    """The model a round starts from: zeros, or this holder's own checkpoint of the last round."""
    if ctx.round == 0:
        return hlr.init_model(n_features)
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
) -> dict[str, Any]:
    """The saved model: plain values only, so it goes through the safe codec. With
    ``preprocessing`` (the pooled statistics it was trained with) scoring applies them."""
    weights = np.asarray(weights, dtype=np.float64)
    record = {
        "job_id": job_id,
        "features": list(features),
        "weights": weights,
        "coefficients": {f: float(w) for f, w in zip(features, weights[:-1], strict=True)},
        "intercept": float(weights[-1]),
        "rounds": rounds,
    }
    if preprocessing is not None:
        record["preprocessing"] = preprocessing
    return record


def model_weights(model: dict[str, Any]) -> np.ndarray:
    """Weight vector (coefficients in ``model['features']`` order, then intercept)."""
    coefficients = [model["coefficients"][f] for f in model["features"]]
    return np.array([*coefficients, model["intercept"]], dtype=np.float64)


def predict_proba(model: dict[str, Any], X: pd.DataFrame | np.ndarray) -> np.ndarray:
    """P(label = 1) for rows of ``X`` (a DataFrame of raw values by column name, transformed
    with the model's preprocessing, or an array already in model order and units)."""
    if isinstance(X, pd.DataFrame):
        X = X.loc[:, model["features"]]
        if model.get("preprocessing") is not None:
            X = FittedPreprocessing.from_dict(model["preprocessing"]).transform(X.to_numpy(float))
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
def join_job(ref: TableRef, job_id: str, workspace: str | None = None) -> dict[str, Any]:
    """Send the coordinator the label and feature column names (no rows, no row count).

    Returns the party's last finished round of this job, so a re-run can resume.
    """
    store = PartyStore.of(ref)
    frame = store.read_table(ref, allow_missing=True)  # imputed or refused before training
    label = ref.label_column or ""
    features = hlr.validate_party_tables({ref.party: frame}, label, ref.id_column, True)
    schema = {"label_column": ref.label_column, "feature_columns": features}
    channel_for(job_id, workspace).endpoint(ref.party).send(COORDINATOR, "schema", schema)
    return _status(store, job_id)


@task(name="hlr-open-job", task_run_name="coordinator: compare columns", **PARTY_STEP)
def open_job(
    parties: list[str],
    job_id: str,
    workspace: str | None = None,
    threshold: int | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Refuse parties whose columns differ; send everyone the agreed feature order.

    With ``timeout`` (party mode), waits for every party's columns until one deadline; the
    parties that have not announced theirs by then are missing from the start (they may still
    join a later round), and fewer than ``threshold`` announcing fails naming the missing ones.
    Returns the agreed features, who announced, and the coordinator's last finished round.
    """
    endpoint = channel_for(job_id, workspace).endpoint(COORDINATOR)
    if timeout is None:
        schemas = {p: endpoint.receive(p, "schema") for p in parties}
    else:
        deadline = time.monotonic() + timeout
        schemas = secure_sum.collect(endpoint, "schema", parties, 0, deadline)
        missing = [p for p in parties if p not in schemas]
        if len(schemas) < (threshold or len(parties)):
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


@task(name="hlr-rollback", task_run_name="{who}: roll back to round {round_}", **PARTY_STEP)
def rollback(who: str, database: str, job_id: str, round_: int) -> dict[str, Any]:
    """Forget rounds after ``round_`` (finished here but not everywhere)."""
    store = PartyStore(database)
    dropped = checkpoints(store, job_id).rollback_to(round_)
    get_run_logger().info("%s: rolled back %d round(s) to round %d", who, dropped, round_)
    return _status(store, job_id)


# ---------------------------------------------------------------------------------------------
# One round, party side


@task(
    name="hlr-mask-update", task_run_name="round {ctx.round}: {ref.party} mask update", **PARTY_STEP
)
def mask_update(ref: TableRef, ctx: RoundContext, options: TrainingOptions) -> None:
    """Secagg step 2: compute the local update on own rows and send it masked.

    The packed vector is ``[rows * update, rows * loss, rows]`` (FedAvg weights by rows), so
    the coordinator learns only the weighted means and the total row count.
    """
    store, endpoint = PartyStore.of(ref), ctx.endpoint(ref.party)
    features = _agreed_features(endpoint)
    weights = _weights_before(store, ctx, len(features), ref.party)
    fitted = stored_fitted(ref.database, ctx.job_id)  # the pooled statistics, if the job has any
    frame = store.read_table(ref, allow_missing=fitted is not None)
    X, y = hlr.party_arrays(frame, features, ref.label_column or "")
    if fitted is not None:
        X = fitted.transform(X, f"party {ref.party}, table {ref.table!r}")
    train = holdout_split(len(y), options.holdout_fraction, ctx.job_id)[0]
    X, y = X[train], y[train]  # held-out rows never reach an update
    if options.local_epochs == 0:
        update = hlr.local_gradient(weights, X, y, options.l2)
    else:
        update = hlr.local_epochs(
            weights, X, y, options.l2, options.learning_rate, options.local_epochs
        )
    secure_sum.party_mask(store, ctx, ref.party, update.packed(), point=model_point(weights))


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
    :func:`tasks.secure_sum.party_mask`, the coordinator cannot have two rounds summed at the
    same model (whose difference, with one party claimed dropped, is that party's update).
    ``own_sum`` is the round's sum as this party unmasked it itself
    (:func:`tasks.secure_sum.party_unmasked_sum`; None if it did not help unmask): the mean
    update must be exactly that sum's, so the coordinator cannot make one up.
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


@task(
    name="hlr-finish-round", task_run_name="round {ctx.round}: {ref.party} save model", **PARTY_STEP
)
def finish_round(
    ref: TableRef, ctx: RoundContext, options: TrainingOptions, final: bool = False
) -> None:
    """Receive the new model, verify it, and checkpoint the round; drop this session's secrets.

    After the last round, the party also keeps its own copy of the model.
    """
    store, endpoint = PartyStore.of(ref), ctx.endpoint(ref.party)
    message = endpoint.receive(COORDINATOR, ctx.kind("model"), round=ctx.round)
    if message["session_id"] != ctx.session_id or message["round"] != ctx.round:
        raise RoundStateError(
            f"{ref.party}: the model message of round {ctx.round} belongs to another attempt"
        )
    features = _agreed_features(endpoint)
    before = _weights_before(store, ctx, len(features), ref.party)
    own_sum = secure_sum.party_unmasked_sum(store, ctx, ref.party, message.get("revealers"))
    weights = verified_model(message, before, options, ref.party, ctx.round, own_sum)
    cps = checkpoints(store, ctx.job_id)
    cps.save(ctx.round, {"weights": weights, "change": message["change"]})
    with secure_sum.session(store, ctx, ref.party) as records:
        records.forget_older_sessions()  # the revealed-senders record stays for the job's life
        if final:
            fitted = stored_fitted(ref.database, ctx.job_id)
            model = model_record(
                ctx.job_id, features, weights, ctx.round + 1, fitted and fitted.to_dict()
            )
            records.artifacts.put(model_key(ctx.job_id), model, "model", con=records.con)
    if final:
        cps.prune(keep_last=2)


# ---------------------------------------------------------------------------------------------
# One round, coordinator side (relaying and unmasking are tasks.secure_sum's steps)


def _agreed_schema(artifacts: ArtifactStore, job_id: str, con: Any = None) -> dict[str, Any]:
    schema = artifacts.get(_schema_key(job_id), con=con)
    if schema is None:
        raise RoundStateError(f"coordinator: no agreed schema for job {job_id}")
    return schema


@task(
    name="hlr-update-model",
    task_run_name="round {ctx.round}: coordinator update model",
    **PARTY_STEP,
)
def update_model(
    ctx: RoundContext,
    options: TrainingOptions,
    started: float,
    responders: list[str] | None = None,
) -> dict[str, Any]:
    """Secagg step 3 (coordinator): unmask the sum, update the model, checkpoint, broadcast.

    Only the weighted mean update, the mean loss and the total row count are ever in the
    clear here; they go to the parties with the new model, which each party recomputes from
    them (:func:`verified_model`). The checkpoint is the round's commit; a retry after it
    only re-sends.
    """
    store, endpoint = coordinator_store(ctx.workspace), ctx.endpoint(COORDINATOR)
    cps = checkpoints(store, ctx.job_id)
    if cps.last_round() >= ctx.round:  # committed before a retry: only re-send
        saved = cps.load(ctx.round)
    else:
        schema = _agreed_schema(ArtifactStore(store), ctx.job_id)
        total, survivors = secure_sum.coordinator_reconstruct(store, ctx, responders)
        mean = unpack_weighted(total)
        previous = cps.load(ctx.round - 1) if ctx.round > 0 else None
        if previous is None:
            before, history = hlr.init_model(len(schema["feature_columns"])), []
        else:
            before, history = np.asarray(previous["weights"]), previous["history"]
        weights = hlr.next_model(before, mean.mean, options.local_epochs, options.learning_rate)
        entry = {
            "round": ctx.round,
            "loss": mean.mean_loss,
            "seconds": round(time.time() - started, 3),
            "survivors": survivors,
            "change": float(np.max(np.abs(weights - before))),
        }
        saved = {
            "weights": weights,
            "mean_update": mean.mean,
            "change": entry["change"],
            "history": [*history, entry],
            "revealers": list(responders) if responders is not None else None,
        }
        cps.save(ctx.round, saved)
        get_run_logger().info(
            "round %d: loss %.6f from %d parties", ctx.round, entry["loss"], len(entry["survivors"])
        )
    message = {
        "session_id": ctx.session_id,
        "round": ctx.round,
        "weights": saved["weights"],
        "mean_update": saved["mean_update"],
        "survivors": saved["history"][-1]["survivors"],
        "revealers": saved.get("revealers"),
        "change": saved["change"],
    }
    for party in ctx.parties:
        endpoint.send(party, ctx.kind("model"), message, round=ctx.round)
    secure_sum.forget_session(store, ctx, COORDINATOR)
    return saved["history"][-1]


@task(name="hlr-coordinator-model", task_run_name="coordinator: store model", **PARTY_STEP)
def coordinator_model(job_id: str, workspace: str | None = None) -> dict[str, Any]:
    """Save the final model in the coordinator's store; return it with the round history."""
    store = coordinator_store(workspace)
    artifacts, cps = ArtifactStore(store), checkpoints(store, job_id)
    last = cps.last_round()
    saved = cps.load(last)
    features = _agreed_schema(artifacts, job_id)["feature_columns"]
    fitted = stored_fitted(str(store.path), job_id)
    model = model_record(job_id, features, saved["weights"], last + 1, fitted and fitted.to_dict())
    artifacts.put(model_key(job_id), model, "model")
    cps.prune(keep_last=2)
    return {**model, "weights": model["weights"].tolist(), "history": saved["history"]}


# ---------------------------------------------------------------------------------------------
# Party mode: each holder is its own process; what a round needs from a peer is a message


@dataclass(frozen=True)
class RoundCall:
    """The coordinator's call for one round (or the stop after the last): what every holder
    must agree on before it contributes. Sent once per round and never changed."""

    session_id: str | None  # None: training is over, keep the last model
    parties: tuple[str, ...]
    threshold: int
    stage_timeout: float
    options: TrainingOptions
    # dropped in an earlier round and not yet asked back: not waited for in this round; each
    # asks to rejoin (:func:`ask_to_rejoin`) and is back from a later round
    out: tuple[str, ...] = ()

    def to_message(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
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
        }

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> RoundCall:
        epochs, rate, l2, tol = message["options"]
        return cls(
            message["session_id"],
            tuple(message["parties"]),
            int(message["threshold"]),
            float(message["stage_timeout"]),
            TrainingOptions(int(epochs), float(rate), float(l2), float(tol)),
            tuple(message.get("out", ())),
        )


@task(
    name="hlr-call-round",
    task_run_name="round {round_}: coordinator calls the round",
    **PARTY_STEP,
)
def call_round(
    job_id: str,
    round_: int,
    parties: list[str],
    threshold: int,
    options: TrainingOptions,
    stage_timeout: float,
    stop: bool = False,
    workspace: str | None = None,
    out: list[str] | None = None,
) -> str | None:
    """Send every party the round's call (a fresh session id) or the stop; return the session.

    ``out`` are the parties left out of this round (dropped before, not yet asked back).
    A coordinator restarted mid-round re-sends the call it already sent (same session), so
    its own session records and the parties' stay valid; a call is never changed once sent.
    """
    endpoint = channel_for(job_id, workspace).endpoint(COORDINATOR)
    already = endpoint.sent(parties[0], "round", round=round_)
    if already is None:
        session_id = None if stop else f"{job_id}/round-{round_}/{secrets.token_hex(8)}"
        left_out = tuple(p for p in parties if p in set(out or ()))
        call = RoundCall(session_id, tuple(parties), threshold, stage_timeout, options, left_out)
        already = call.to_message()
    for party in parties:
        endpoint.send(party, "round", already, round=round_)
    return already["session_id"]


@task(
    name="hlr-await-round",
    task_run_name="round {round_}: {ref.party} awaits the call",
    cache_policy=PARTY_STEP["cache_policy"],
)
def await_round(
    ref: TableRef,
    job_id: str,
    round_: int,
    parties: list[str],
    options: TrainingOptions,
) -> RoundContext | None:
    """The coordinator's call for ``round_`` as this party's round context (None: stop).

    The call must name the parties this party agreed to and its own training options (a
    coordinator changing the learning rate or the peers is refused, naming what differs).
    """
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
    if call.session_id is None:
        return None
    n_features = len(_agreed_features(endpoint))
    return round_context(
        job_id,
        round_,
        call.session_id,
        call.parties,
        call.threshold,
        n_features,
        stage_timeout=call.stage_timeout,
    )


def left_out(ref: TableRef, ctx: RoundContext) -> bool:
    """Whether the coordinator's call for this round leaves this party out (it was dropped
    in an earlier round): it then asks to rejoin and only takes the round's model."""
    call = ctx.endpoint(ref.party).receive(COORDINATOR, "round", round=ctx.round)
    return ref.party in RoundCall.from_message(call).out


def ask_to_rejoin(ref: TableRef, ctx: RoundContext) -> None:
    """Tell the coordinator this party is back; it is called again from a later round.

    Each round it is left out of, a live party asks again, so a request that arrives after the
    coordinator called the next round only delays the return by one round.
    """
    ctx.endpoint(ref.party).send(COORDINATOR, "rejoin", {"party": ref.party}, round=ctx.round)


def rejoin_requests(
    job_id: str, round_: int, candidates: list[str], workspace: str | None = None
) -> list[str]:
    """Coordinator: which of ``candidates`` (left out of ``round_``) asked to rejoin in it.

    Only looks at what has arrived; a party that is gone for good costs nothing here.
    """
    if not candidates or round_ < 0:
        return []
    endpoint = channel_for(job_id, workspace).endpoint(COORDINATOR)
    return list(secure_sum.collect(endpoint, "rejoin", candidates, round_, 0, None))


def round_open(ref: TableRef, ctx: RoundContext) -> bool:
    """Whether the coordinator has not yet sent this round's model (the round is still open
    for this party: a restarted party catches up, a waiting one is not yet dropped)."""
    endpoint = ctx.endpoint(ref.party)
    return not secure_sum.collect(endpoint, ctx.kind("model"), [COORDINATOR], ctx.round, 0)


@task(name="hlr-keep-model", task_run_name="{ref.party}: keep the model", **PARTY_STEP)
def keep_model(ref: TableRef, job_id: str) -> dict[str, Any]:
    """After the coordinator's stop: this party's own copy of the last verified model."""
    store = PartyStore.of(ref)
    cps = checkpoints(store, job_id)
    last = cps.last_round()
    if last < 0:
        raise RoundStateError(f"{ref.party}: job {job_id} stopped before any round finished")
    saved = cps.load(last)
    features = _agreed_features(channel_for(job_id).endpoint(ref.party))
    fitted = stored_fitted(ref.database, job_id)
    model = model_record(job_id, features, saved["weights"], last + 1, fitted and fitted.to_dict())
    ArtifactStore(store).put(model_key(job_id), model, "model")
    cps.prune(keep_last=2)
    return {**model, "weights": model["weights"].tolist()}
