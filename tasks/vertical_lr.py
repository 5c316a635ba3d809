"""Vertical logistic regression, one task per party step (maths in :mod:`core.vertical_lr`).

Parties: a *guest* (labels and some features), one or more *hosts* (other features of the
same aligned rows) and a *key holder*: the arbiter, or the guest itself in two-party mode.
Every step reads the state it starts from by explicit round index, so re-running a round
after a fault recomputes it whole from the previous round's checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from phe import paillier
from prefect import task

from core.ids import id_order_digest
from core.paillier import cipher
from core.paillier.keys import MIN_SECURE_KEY_BITS, generate_keypair
from core.vertical_lr.fixed_point import decode_gradient, encode_features
from core.vertical_lr.schedule import Schedule
from core.vertical_lr.steps import (
    Optimizer,
    decode_loss,
    guest_shares,
    host_share,
    labels_pm1,
    loss_coefficients,
)
from storage.artifacts import ArtifactStore
from storage.channel import PartyEndpoint
from storage.checkpoints import RoundCheckpoints
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.workspace import channel_for
from tasks.policy import PARTY_STEP

PROTOCOL = "vertical"


class VerticalSetupError(ValueError):
    """The parties' inputs cannot be trained on together."""


@dataclass(frozen=True)
class VerticalJob:
    """Everything a party step needs besides its own table: small and public."""

    job_id: str
    workspace: str | None
    guest: str
    hosts: tuple[str, ...]
    key_holder: str
    key_holder_database: str
    schedule: Schedule
    learning_rate: float
    momentum: float
    decay: float
    l2: float
    randomizer: str = cipher.DEFAULT_RANDOMIZER
    clip_features: float | None = None

    @property
    def with_arbiter(self) -> bool:
        return self.key_holder != self.guest

    def endpoint(self, party: str) -> PartyEndpoint:
        return channel_for(self.job_id, self.workspace).endpoint(party)

    def optimizer(self, velocity: dict[str, np.ndarray]) -> Optimizer:
        return Optimizer(self.learning_rate, self.momentum, self.decay, self.l2, dict(velocity))


def _artifacts(database: str) -> ArtifactStore:
    return ArtifactStore(PartyStore(database))


def _key(job: VerticalJob, *parts: object) -> str:
    return "/".join([PROTOCOL, job.job_id, *map(str, parts)])


def _deliver(
    job: VerticalJob,
    sender: str,
    sender_db: str,
    receiver: str,
    kind: str,
    payload: Any,
    round_: int,
) -> None:
    """Send through the channel, or keep locally when a party plays two roles."""
    if receiver == sender:
        _artifacts(sender_db).put(_key(job, "local", round_, kind), payload, "local-message")
    else:
        job.endpoint(sender).send(receiver, kind, payload, round=round_)


def _collect(
    job: VerticalJob, receiver: str, receiver_db: str, sender: str, kind: str, round_: int
) -> Any:
    if receiver == sender:
        return _artifacts(receiver_db).get(_key(job, "local", round_, kind))
    return job.endpoint(receiver).receive(sender, kind, round=round_)


def _public_key(job: VerticalJob, ref: TableRef) -> paillier.PaillierPublicKey:
    artifacts = ArtifactStore(PartyStore.of(ref))
    n = artifacts.get(_key(job, "public_key"))
    if n is None:
        if ref.party == job.key_holder:
            n = _artifacts(job.key_holder_database).get(_key(job, "keypair"))["n"]
        else:
            n = job.endpoint(ref.party).receive(job.key_holder, "public_key")
        artifacts.put(_key(job, "public_key"), n, "public-key")
    return paillier.PaillierPublicKey(int(n))


def _features(ref: TableRef, clip: float | None) -> tuple[np.ndarray, list[str], np.ndarray | None]:
    """The party's features, clipped to [-clip, clip] when asked (a purely local step that
    tames outliers, which the Taylor approximation handles badly)."""
    frame = PartyStore.of(ref).read_table(ref)
    names = [c for c in frame.columns if c not in (ref.id_column, ref.label_column)]
    labels = frame[ref.label_column].to_numpy() if ref.label_column else None
    X = frame[names].to_numpy(dtype=float)
    return (X if clip is None else np.clip(X, -clip, clip)), names, labels


def _guest_matrix(ref: TableRef, clip: float | None) -> tuple[np.ndarray, list[str], np.ndarray]:
    X, names, labels = _features(ref, clip)
    return np.hstack([np.ones((len(X), 1)), X]), ["intercept", *names], labels


def _state(job: VerticalJob, ref: TableRef, round_: int, width: int) -> dict[str, Any]:
    """The party's weights and optimizer velocity after ``round_`` (zeros before round 0)."""
    if round_ < 0:
        return {"weights": np.zeros(width), "velocity": {}}
    return RoundCheckpoints(PartyStore.of(ref), PROTOCOL, job.job_id).load(round_)


def _rows(job: VerticalJob, round_: int, phase: str) -> np.ndarray:
    if phase == "holdout":
        return job.schedule.holdout_rows
    return job.schedule.batch(*job.schedule.position(round_))


def _weights_round(round_: int, phase: str) -> int:
    """Training rounds use the weights before the round; hold-out checks the weights after it."""
    return round_ if phase == "holdout" else round_ - 1


# ---- set-up -------------------------------------------------------------------------------
@task(name="vertical-keys", task_run_name="{job.key_holder}: key pair", **PARTY_STEP)
def create_keys(job: VerticalJob, key_size: int, allow_insecure_key_size: bool = False) -> int:
    """The key holder's Paillier key pair, created once per job and kept in its store only."""
    if key_size < MIN_SECURE_KEY_BITS and not allow_insecure_key_size:
        raise VerticalSetupError(
            f"key_size={key_size} is below {MIN_SECURE_KEY_BITS} bits; smaller keys are for "
            "tests only and need allow_insecure_key_size=True"
        )
    artifacts = _artifacts(job.key_holder_database)
    stored = artifacts.get(_key(job, "keypair"))
    if stored is None:
        public, private = generate_keypair(
            key_size, allow_insecure_key_size=allow_insecure_key_size
        )
        stored = {"n": public.n, "p": private.p, "q": private.q}
        artifacts.put(_key(job, "keypair"), stored, "secret")
    for party in (job.guest, *job.hosts):
        if party != job.key_holder:
            job.endpoint(job.key_holder).send(party, "public_key", stored["n"])
    return int(stored["n"]).bit_length()


@task(name="vertical-check", task_run_name="{ref.party}: check table", **PARTY_STEP)
def check_party(job: VerticalJob, ref: TableRef, role: str) -> dict[str, Any]:
    """Refuse bad inputs before any round; send the guest a digest of the aligned id order."""
    frame = PartyStore.of(ref).read_table(ref)
    if role == "host" and ref.label_column is not None:
        raise VerticalSetupError(
            f"host {ref.party} declares label column {ref.label_column!r}: only the guest may "
            "hold labels"
        )
    if role == "guest":
        if ref.label_column is None:
            raise VerticalSetupError(f"guest table {ref.table!r} has no label column")
        labels = set(np.unique(frame[ref.label_column]).tolist())
        if not labels <= {0.0, 1.0} or len(labels) < 2:
            raise VerticalSetupError(
                f"table {ref.table!r}, column {ref.label_column!r}: labels must be binary "
                f"0/1 with both classes present, found {sorted(labels)[:5]}"
            )
    X = frame.drop(columns=[c for c in (ref.id_column, ref.label_column) if c]).to_numpy(float)
    encode_features(X, [c for c in frame.columns if c not in (ref.id_column, ref.label_column)])
    digest = id_order_digest(job.job_id, frame[ref.id_column])
    if ref.party != job.guest:
        job.endpoint(ref.party).send(job.guest, "id_order_digest", digest)
    else:
        _artifacts(ref.database).put(_key(job, "id_order_digest"), digest, "digest")
    return {"party": ref.party, "rows": len(frame), "features": X.shape[1]}


@task(name="vertical-aligned", task_run_name="{ref.party}: check alignment", **PARTY_STEP)
def check_alignment(job: VerticalJob, ref: TableRef) -> None:
    """The guest compares the hosts' id-order digests with its own (reveals only equal or not)."""
    own = _artifacts(ref.database).get(_key(job, "id_order_digest"))
    for host in job.hosts:
        if job.endpoint(ref.party).receive(host, "id_order_digest") != own:
            raise VerticalSetupError(
                f"tables of {ref.party} and {host} are not aligned (different ids or order); "
                "run psi_align first and train on the *_aligned tables"
            )


# ---- one round ------------------------------------------------------------------------------
@task(
    name="vertical-host-share",
    task_run_name="r{round_} {phase} · {ref.party}: [[Xw/4]]",
    **PARTY_STEP,
)
def host_forward(job: VerticalJob, ref: TableRef, round_: int, phase: str = "train") -> None:
    """A host encrypts its score share for the batch and sends it to the guest (and to later
    hosts, which need it for the loss's cross terms)."""
    X, _, _ = _features(ref, job.clip_features)
    weights = _state(job, ref, _weights_round(round_, phase), X.shape[1])["weights"]
    rows = _rows(job, round_, phase)
    public = _public_key(job, ref)
    share = host_share(X[rows], weights)
    encrypted = cipher.encrypt(public, share, job.randomizer)
    endpoint = job.endpoint(ref.party)
    endpoint.send(job.guest, f"share_{phase}", encrypted, round=round_)
    endpoint.send(
        job.guest,
        f"square_{phase}",
        cipher.encrypt(public, [sum(a * a for a in share)], job.randomizer),
        round=round_,
    )
    position = job.hosts.index(ref.party)
    for later in job.hosts[position + 1 :]:
        endpoint.send(later, f"share_{phase}", encrypted, round=round_)
    if len(job.hosts) > 1:
        _artifacts(ref.database).put(_key(job, "share", phase, round_), share, "round-temp")


@task(
    name="vertical-host-cross",
    task_run_name="r{round_} {phase} · {ref.party}: cross terms",
    **PARTY_STEP,
)
def host_cross_terms(job: VerticalJob, ref: TableRef, round_: int, phase: str = "train") -> None:
    """With several hosts, ``sum(A^2)`` needs ``sum_i a_h a_h'``: host h' folds its own share
    into each earlier host's encrypted share."""
    public = _public_key(job, ref)
    own = _artifacts(ref.database).get(_key(job, "share", phase, round_))
    endpoint = job.endpoint(ref.party)
    for earlier in job.hosts[: job.hosts.index(ref.party)]:
        theirs = endpoint.receive(earlier, f"share_{phase}", round=round_)
        cross = cipher.weighted_sum(public, theirs, own)
        # re-randomised: a product of the guest's known ciphertexts would let it test guesses
        endpoint.send(
            job.guest,
            f"cross_{earlier}_{phase}",
            cipher.rerandomize(public, [cross], job.randomizer),
            round=round_,
        )


@task(
    name="vertical-guest-residual",
    task_run_name="r{round_} {phase} · {ref.party}: [[d]] and [[loss]]",
    **PARTY_STEP,
)
def guest_residual(job: VerticalJob, ref: TableRef, round_: int, phase: str = "train") -> None:
    """The guest adds its plaintext part to the hosts' encrypted shares, sends each host a
    re-randomised ``[[d]]``, folds the encrypted Taylor loss for the key holder and, in a
    training round, masks its own encrypted gradient for decryption."""
    X, _, labels = _guest_matrix(ref, job.clip_features)
    weights = _state(job, ref, _weights_round(round_, phase), X.shape[1])["weights"]
    rows = _rows(job, round_, phase)
    y = labels_pm1(labels[rows])
    public = _public_key(job, ref)
    endpoint = job.endpoint(ref.party)
    total: list[int] | None = None
    loss_terms: list[int] = []
    for host in job.hosts:
        share = endpoint.receive(host, f"share_{phase}", round=round_)
        total = share if total is None else cipher.add(public, total, share)
        loss_terms.append(endpoint.receive(host, f"square_{phase}", round=round_)[0])
    for position, later in enumerate(job.hosts):
        for earlier in job.hosts[:position]:
            cross = endpoint.receive(later, f"cross_{earlier}_{phase}", round=round_)[0]
            loss_terms.append(cipher.weighted_sum(public, [cross], [2]))
    b, q = guest_shares(X[rows], weights, y)
    coefficients, constant = loss_coefficients(q, y)
    loss = cipher.weighted_sum(
        public, [*total, *loss_terms], [*coefficients, *[1] * len(loss_terms)]
    )
    loss = cipher.add_plain(public, [loss], [constant])
    _deliver(
        job,
        ref.party,
        ref.database,
        job.key_holder,
        f"loss_{phase}",
        cipher.rerandomize(public, loss, job.randomizer),
        round_,
    )
    if phase != "train":
        return
    residual = cipher.add_plain(public, total, b)
    # one re-randomisation serves every host: it unlinks [[d]] from each host's own shares
    fresh = cipher.rerandomize(public, residual, job.randomizer)
    for host in job.hosts:
        endpoint.send(host, "residual", fresh, round=round_)
    _mask_and_send(job, ref, public, encode_features(X[rows]), residual, round_)


def _mask_and_send(
    job: VerticalJob,
    ref: TableRef,
    public: paillier.PaillierPublicKey,
    X_int: np.ndarray,
    residual: list[int],
    round_: int,
) -> None:
    """``[[X^T d + r]]`` to the key holder; the mask ``r`` stays in the party's store."""
    gradient = cipher.transpose_dot(public, X_int, residual)
    masks = cipher.random_masks(len(gradient))
    _artifacts(ref.database).put(_key(job, "mask", round_), masks, "round-temp")
    _deliver(
        job,
        ref.party,
        ref.database,
        job.key_holder,
        "masked_gradient",
        cipher.add_plain(public, gradient, masks),
        round_,
    )


@task(
    name="vertical-host-gradient",
    task_run_name="r{round_} · {ref.party}: [[X^T d]] + mask",
    **PARTY_STEP,
)
def host_gradient(job: VerticalJob, ref: TableRef, round_: int) -> None:
    X, _, _ = _features(ref, job.clip_features)
    rows = _rows(job, round_, "train")
    residual = job.endpoint(ref.party).receive(job.guest, "residual", round=round_)
    _mask_and_send(job, ref, _public_key(job, ref), encode_features(X[rows]), residual, round_)


@task(
    name="vertical-decrypt",
    task_run_name="r{round_} {phase} · {job.key_holder}: decrypt",
    **PARTY_STEP,
)
def key_holder_decrypt(job: VerticalJob, round_: int, phase: str = "train") -> float:
    """Decrypt the loss (a public training metric) and the *masked* gradients, and return each
    masked gradient to its owner. The key holder never sees an unmasked gradient or weight."""
    stored = _artifacts(job.key_holder_database).get(_key(job, "keypair"))
    public = paillier.PaillierPublicKey(int(stored["n"]))
    private = paillier.PaillierPrivateKey(public, int(stored["p"]), int(stored["q"]))
    db = job.key_holder_database
    encrypted_loss = _collect(job, job.key_holder, db, job.guest, f"loss_{phase}", round_)
    n_rows = len(_rows(job, round_, phase))
    loss = decode_loss(cipher.decrypt(private, encrypted_loss)[0], n_rows)
    if phase == "train":
        for party in (job.guest, *job.hosts):
            masked = _collect(job, job.key_holder, db, party, "masked_gradient", round_)
            _deliver(
                job,
                job.key_holder,
                db,
                party,
                "masked_gradient_plain",
                cipher.decrypt(private, masked),
                round_,
            )
    return loss


@task(
    name="vertical-update", task_run_name="r{round_} · {ref.party}: unmask and update", **PARTY_STEP
)
def update_weights(job: VerticalJob, ref: TableRef, round_: int, role: str) -> float:
    """Remove the mask, take the optimizer step, checkpoint the round. Returns the squared
    norm of this party's gradient (for the round table)."""
    if role == "guest":
        X, _, _ = _guest_matrix(ref, job.clip_features)
        penalised = np.r_[0.0, np.ones(X.shape[1] - 1)]
    else:
        X, _, _ = _features(ref, job.clip_features)
        penalised = np.ones(X.shape[1])
    state = _state(job, ref, round_ - 1, X.shape[1])
    artifacts = _artifacts(ref.database)
    masks = artifacts.get(_key(job, "mask", round_))
    masked = _collect(job, ref.party, ref.database, job.key_holder, "masked_gradient_plain", round_)
    gradient_sum = [m - r for m, r in zip(masked, masks, strict=True)]
    optimizer = job.optimizer(state["velocity"])
    epoch, _ = job.schedule.position(round_)
    rows = len(_rows(job, round_, "train"))
    weights = optimizer.step(ref.party, state["weights"], gradient_sum, rows, epoch, penalised)
    gradient = decode_gradient(gradient_sum, rows) + job.l2 * state["weights"] * penalised
    checkpoints = RoundCheckpoints(PartyStore.of(ref), PROTOCOL, job.job_id)
    checkpoints.save(round_, {"weights": weights, "velocity": optimizer.velocity})
    checkpoints.prune(keep_last=3)
    artifacts.delete_prefix(_key(job, "mask", round_))
    return float(np.sum(gradient**2))


# ---- resume, model, scoring ------------------------------------------------------------------
@task(name="vertical-last-round", task_run_name="{ref.party}: last finished round", **PARTY_STEP)
def last_round(job: VerticalJob, ref: TableRef) -> int:
    return RoundCheckpoints(PartyStore.of(ref), PROTOCOL, job.job_id).last_round()


@task(
    name="vertical-rollback", task_run_name="{ref.party}: roll back to round {round_}", **PARTY_STEP
)
def rollback(job: VerticalJob, ref: TableRef, round_: int) -> int:
    return RoundCheckpoints(PartyStore.of(ref), PROTOCOL, job.job_id).rollback_to(round_)


@task(name="vertical-save-model", task_run_name="{ref.party}: save model slice", **PARTY_STEP)
def save_model(job: VerticalJob, ref: TableRef, round_: int, role: str) -> dict[str, Any]:
    """Store this party's slice of the model (by feature name) in its own database."""
    X, names, _ = (
        _guest_matrix(ref, job.clip_features)
        if role == "guest"
        else _features(ref, job.clip_features)
    )
    weights = _state(job, ref, round_, X.shape[1])["weights"]
    model = {"features": names, "weights": weights, "round": round_, "job_id": job.job_id}
    key = f"models/vertical/{job.job_id}/{ref.party}"
    _artifacts(ref.database).put(key, model, "model")
    return {"key": key, "coefficients": dict(zip(names, weights.tolist(), strict=True))}


@task(name="vertical-host-scores", task_run_name="{ref.party}: scores for the guest", **PARTY_STEP)
def host_scores(job: VerticalJob, ref: TableRef) -> None:
    """Scoring: a host sends the guest its plaintext score share ``X_h w_h`` (as FATE's
    predict does); the guest learns these sums, never the host's features or weights."""
    model = _artifacts(ref.database).get(f"models/vertical/{job.job_id}/{ref.party}")
    X, _, _ = _features(ref, job.clip_features)
    job.endpoint(ref.party).send(job.guest, "scores", X @ model["weights"], round=0)


@task(
    name="vertical-guest-predict", task_run_name="{ref.party}: predict and evaluate", **PARTY_STEP
)
def guest_predict(job: VerticalJob, ref: TableRef) -> dict[str, Any]:
    """The guest's probabilities for every aligned row, stored in its database, and metrics."""
    from sklearn.metrics import log_loss, roc_auc_score

    model = _artifacts(ref.database).get(f"models/vertical/{job.job_id}/{ref.party}")
    X, _, labels = _guest_matrix(ref, job.clip_features)
    scores = X @ model["weights"]
    for host in job.hosts:
        scores = scores + job.endpoint(ref.party).receive(host, "scores", round=0)
    probabilities = 1.0 / (1.0 + np.exp(-scores))
    store = PartyStore.of(ref)
    frame = store.read_table(ref)[[ref.id_column]].assign(probability=probabilities)
    store.write_table(f"{ref.table}_scores", frame)
    metrics = {}
    for name, rows in (("train", job.schedule.train_rows), ("holdout", job.schedule.holdout_rows)):
        if len(rows) and len(set(labels[rows])) == 2:
            metrics[f"{name}_auc"] = float(roc_auc_score(labels[rows], probabilities[rows]))
            metrics[f"{name}_log_loss"] = float(log_loss(labels[rows], probabilities[rows]))
    return {
        "metrics": metrics,
        "scores_table": f"{ref.table}_scores",
        "probabilities": probabilities,
    }
