"""Vertical logistic regression, one task per party step (maths in :mod:`core.vertical_lr`).

More (the protocol, what each party learns, why): docs/protocols/vertical-lr.md.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import duckdb
import numpy as np
import pandas as pd
from phe import paillier
from prefect import get_run_logger, task

from core.charts import exact_auc
from core.ids import id_order_digest, require_aligned
from core.job_checks import LABEL_LEAK_MARGIN
from core.model_format import ModelRecord
from core.outcomes import DivergenceError
from core.paillier import cipher
from core.paillier.errors import PaillierError
from core.paillier.keys import (
    DEFAULT_KEY_BITS,
    check_key_size,
    check_peer_modulus,
    small_keys_allowed,
)
from core.paillier.randomness import ObfuscatorFile, ObfuscatorPool, discard_pool, pool_path
from core.preprocessing import PreprocessingSpec
from core.vertical_lr import packing
from core.vertical_lr.fixed_point import ResidualRangeError, decode_gradient, encode_features
from core.vertical_lr.schedule import Schedule
from core.vertical_lr.steps import (
    Optimizer,
    decode_loss,
    guest_shares,
    host_share,
    labels_pm1,
    loss_coefficients,
)
from federation.channel import Channel, PartyEndpoint
from storage import codec
from storage.artifacts import ArtifactStore
from storage.checkpoints import RoundCheckpoints
from storage.descriptor import TableRef
from storage.models import ModelStore, model_key
from storage.party_store import PartyStore
from storage.secrets import JobKeyPair
from tasks import secure_sum
from tasks.feature_cache import PartyFeatures, party_features
from tasks.policy import PARTY_STEP
from tasks.reporting import provenance
from tasks.summaries import log_loss

PROTOCOL = "vertical"
KEEP_ROUNDS = 3  # round checkpoints kept, and the sent messages (and masks) of as many rounds


class VerticalSetupError(ValueError):
    """The parties' inputs cannot be trained on together."""


class KeyHolderRefusalError(ValueError):
    """The key holder refused to decrypt a party's message (named in the error)."""


@contextmanager
def _in_range(job: VerticalJob, round_: int) -> Iterator[None]:
    """A residual beyond the fixed-point bound ends the run as a divergence of this round."""
    try:
        yield
    except ResidualRangeError as error:
        raise DivergenceError(
            "vertical_lr", job.job_id, round_, math.nan, math.nan, cause=str(error)
        ) from None


@dataclass(frozen=True)
class VerticalJob:
    """Everything a party step needs besides its own table: small and public."""

    job_id: str
    channel: Channel = field(compare=False, repr=False)  # this side's, built once by its flow
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
    # each party's own columns are imputed and scaled with their own statistics
    preprocessing: PreprocessingSpec = field(default_factory=PreprocessingSpec)
    # (party, length of its gradient) agreed at set-up: the guest's features + intercept,
    # each host's features. The key holder decrypts nothing of another length.
    widths: tuple[tuple[str, int], ...] = ()
    # the key the job's terms state: every encrypting party checks the key holder's n against
    # it before encrypting anything (core.paillier.keys.check_peer_modulus)
    key_size: int = DEFAULT_KEY_BITS

    @property
    def with_arbiter(self) -> bool:
        return self.key_holder != self.guest

    @property
    def key_holder_peers(self) -> tuple[str, ...]:
        """Every party but the key holder: each gets ``n`` and the stop decision from it."""
        return tuple(p for p in (self.guest, *self.hosts) if p != self.key_holder)

    def width(self, party: str) -> int:
        widths = dict(self.widths)
        if party not in widths:
            raise VerticalSetupError(f"no gradient length was agreed for party {party!r}")
        return widths[party]

    def endpoint(self, party: str) -> PartyEndpoint:
        return self.channel.endpoint(party)

    def optimizer(self, velocity: dict[str, np.ndarray]) -> Optimizer:
        return Optimizer(self.learning_rate, self.momentum, self.decay, self.l2, dict(velocity))


def _artifacts(database: str) -> ArtifactStore:
    return ArtifactStore(PartyStore(database))


def _key(job: VerticalJob, *parts: object) -> str:
    return "/".join([PROTOCOL, job.job_id, *map(str, parts)])


def _saved_model(job: VerticalJob, ref: TableRef) -> dict[str, Any] | None:
    """The party's saved share of the model (None while the job trains)."""
    return _artifacts(ref.database).get(model_key(PROTOCOL, job.job_id, ref.party))


def job_key_pair(job: VerticalJob) -> JobKeyPair:
    """The key holder's key pair for this job: p, q sealed under a key file that
    :func:`retire_key` shreds, never in its database in the clear."""
    return JobKeyPair(PartyStore(job.key_holder_database), _key(job))


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
    else:  # a re-run round sends the same plaintexts: the message already sent stands
        job.endpoint(sender).send_once(receiver, kind, lambda: payload, round=round_)


def _deliver_once(
    job: VerticalJob,
    ref: TableRef,
    kind: str,
    round_: int,
    compute: Callable[[], dict[str, Any]],
    stored: dict[str, Any] | None,
) -> None:
    """Send the key holder this round's ``kind`` message, computed (``{"message": ...}``, plus
    e.g. the masks) and stored before it is sent unless ``stored`` (:func:`_read_step`) has it:
    a re-run round re-sends the same bytes, so no party asks twice with other ciphertexts."""
    record = stored
    if record is None:
        record = compute()
        _artifacts(ref.database).put(_sent_key(job, kind, round_), record, "round-temp")
    _deliver(job, ref.party, ref.database, job.key_holder, kind, record["message"], round_)


def _sent_key(job: VerticalJob, kind: str, round_: int) -> str:
    return _key(job, "sent", kind, f"{round_:07d}")


def _forget_sent(
    job: VerticalJob, ref: TableRef, round_: int, con: duckdb.DuckDBPyConnection
) -> None:
    """Drop sent messages (and masks) of rounds no rollback can return to, in the caller's
    transaction (the one that checkpoints ``round_``)."""
    old = round_ - KEEP_ROUNDS
    if old >= 0:
        artifacts = _artifacts(ref.database)
        for kind in ("masked_gradient", "loss_train", "loss_holdout"):
            artifacts.delete_prefix(_sent_key(job, kind, old), con=con)


@dataclass(frozen=True)
class StepInputs:
    """What a party's round step reads from its own store, in one session (:func:`_read_step`)."""

    public: paillier.PaillierPublicKey
    weights: np.ndarray | None  # the weights the step starts from, when it needs them
    sent: dict[str, dict[str, Any] | None]  # this round's stored messages, by kind


def _read_step(
    job: VerticalJob,
    ref: TableRef,
    round_: int,
    weights_round: int | None = None,
    width: int = 0,
    sent: tuple[str, ...] = (),
) -> StepInputs:
    """The job's public key, the weights after ``weights_round`` (None: not needed) and the
    records of this round's ``sent`` kinds, read in one session of the party's database.
    A public key not yet stored is awaited from the key holder after the session ends, so
    the wait never holds the database."""
    artifacts = _artifacts(ref.database)
    with PartyStore.of(ref).session():
        n = artifacts.get(_key(job, "public_key"))
        weights = None
        if weights_round is not None:
            weights = _state(job, ref, weights_round, width)["weights"]
        records = {kind: artifacts.get(_sent_key(job, kind, round_)) for kind in sent}
    return StepInputs(_public_key(job, ref, n), weights, records)


def check_batches(schedule: Schedule, host_features: dict[str, int]) -> None:
    """Refuse a schedule whose smallest mini-batch would let a host solve for the labels
    (why ``features + 64`` rows, and what it does not stop: docs/protocols/vertical-lr.md)."""
    train = len(schedule.train_rows)
    last = train - (schedule.batches_per_epoch - 1) * schedule.batch_size
    smallest = min(schedule.batch_size, last)
    for host, features in host_features.items():
        if smallest < features + LABEL_LEAK_MARGIN:
            raise VerticalSetupError(
                f"host {host} has {features} features, so a mini-batch needs at least "
                f"{features + LABEL_LEAK_MARGIN} rows (features + {LABEL_LEAK_MARGIN}) or its "
                f"gradient leaks labels; the smallest batch of this schedule has {smallest} "
                f"rows ({train} training rows, batch_size {schedule.batch_size}): use a larger "
                "batch_size or more rows"
            )


def _decrypt_once(
    job: VerticalJob,
    private: paillier.PaillierPrivateKey,
    sender: str,
    kind: str,
    round_: int,
    ciphertexts: Any,
    length: int,
) -> list[int]:
    """The key holder's only way to decrypt a party's message: of the length agreed for the
    sender at set-up (:func:`gradient_layout`; 1 for the loss), once per sender, kind and
    round, and units modulo n^2 only. What each refusal stops, and what it cannot stop
    without proofs: docs/protocols/vertical-lr.md (what each party learns)."""
    if not isinstance(ciphertexts, list) or len(ciphertexts) != length:
        got = len(ciphertexts) if isinstance(ciphertexts, list) else type(ciphertexts).__name__
        raise KeyHolderRefusalError(
            f"{job.key_holder} refuses the {kind} of {sender} for round {round_}: it has "
            f"{got} values, the length agreed at set-up is {length}"
        )
    digest = hashlib.sha256(codec.dumps(ciphertexts)).hexdigest()
    artifacts = _artifacts(job.key_holder_database)
    record = _key(job, "decrypted", kind, f"{round_:07d}", sender)
    # check, decrypt and record in one transaction: atomic, and one connection instead of two
    with artifacts.store.serialized(), artifacts.store.transaction() as con:
        seen = artifacts.get(record, con=con)
        if seen is not None and seen != digest:
            raise KeyHolderRefusalError(
                f"{job.key_holder} refuses a second, different {kind} from {sender} for round "
                f"{round_}: each party's message is decrypted at most once per round"
            )
        try:
            plain = cipher.decrypt(private, ciphertexts)
        except (PaillierError, TypeError) as error:
            raise KeyHolderRefusalError(
                f"{job.key_holder} refuses the {kind} of {sender} for round {round_}: {error}"
            ) from None
        if seen is None:
            artifacts.put(record, digest, "decryption-record", con=con)
    return plain


def _collect(
    job: VerticalJob, receiver: str, receiver_db: str, sender: str, kind: str, round_: int
) -> Any:
    if receiver == sender:
        return _artifacts(receiver_db).get(_key(job, "local", round_, kind))
    return job.endpoint(receiver).receive(sender, kind, round=round_)


def prefetch(job: VerticalJob, receiver: str, sender: str, kind: str, round_: int = 0) -> None:
    """:func:`tasks.secure_sum.prefetch` at ``receiver``'s endpoint of the job."""
    secure_sum.prefetch(job.endpoint(receiver), sender, kind, round_)


def _collect_all(
    job: VerticalJob,
    receiver: str,
    receiver_db: str,
    wanted: Sequence[tuple[str, str]],
    round_: int,
) -> list[Any]:
    """Each ``(sender, kind)`` message of the round, in order, fetched side by side: the
    waits overlap, so the last to arrive costs one wait, not one round trip each."""
    for sender, kind in wanted[1:]:
        prefetch(job, receiver, sender, kind, round_)
    return [_collect(job, receiver, receiver_db, sender, kind, round_) for sender, kind in wanted]


def _public_key(
    job: VerticalJob, ref: TableRef, stored: int | None = None
) -> paillier.PaillierPublicKey:
    """The job's public key: ``stored`` (the ``n`` the caller has just read from the party's
    store), else the store's, else fetched once (from the key holder), checked and stored.
    Every encrypting party other than the key holder gets ``n`` here, so this is where it
    refuses a modulus that is too small, of another size than the job states, or malformed."""
    artifacts = ArtifactStore(PartyStore.of(ref))
    n = stored if stored is not None else artifacts.get(_key(job, "public_key"))
    if n is None:
        if ref.party == job.key_holder:
            n = job_key_pair(job).n()
            if n is None:
                raise VerticalSetupError(f"job {job.job_id}: {job.key_holder} has no key pair")
        else:
            n = check_peer_modulus(
                job.endpoint(ref.party).receive(job.key_holder, "public_key"),
                expected_bits=job.key_size,
                allow_insecure_key_size=small_keys_allowed(),  # this party's own opt-in
                holder=job.key_holder,
            )
        artifacts.put(_key(job, "public_key"), n, "public-key")
    return paillier.PaillierPublicKey(int(n))


def _features(ref: TableRef, job: VerticalJob) -> PartyFeatures:
    """The party's features, preprocessed with its own columns' statistics (nothing leaves
    the party) and clipped when asked, read once per flow run."""
    return party_features(ref, job.clip_features, preprocessing=job.preprocessing)


def _matrix(
    ref: TableRef, job: VerticalJob, role: str
) -> tuple[np.ndarray, list[str], PartyFeatures]:
    """The party's matrix and its columns' names (the guest's first is the intercept's)."""
    features = _features(ref, job)
    X, names = features.X, list(features.names)
    if role == "guest":
        X, names = np.hstack([np.ones((len(X), 1)), X]), ["intercept", *names]
    return X, names, features


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


def _pool(
    job: VerticalJob, ref: TableRef, public: paillier.PaillierPublicKey
) -> ObfuscatorFile | ObfuscatorPool:
    """The party's own pool of obfuscators for this job's key if it prepared one, else the
    ones its process computed ahead (:func:`obfuscators_ahead`; the rest on demand)."""
    prepared = cipher.party_pool(ref.database, public, job.randomizer)
    return (
        prepared if prepared is not None else cipher.ahead_pool(ref.party, public, job.randomizer)
    )


def obfuscators_ahead(job: VerticalJob, ref: TableRef, count: int) -> None:
    """Before a wait for a peer: compute the ``count`` obfuscators this party draws next, so
    its encryption runs while it would idle (they do not depend on what they will hide). A
    party with a prepared pool draws from that instead and computes nothing here."""
    public = _public_key(job, ref)
    pool = _pool(job, ref, public)
    if isinstance(pool, ObfuscatorPool):
        cipher.fill_ahead(pool, count)


def plan_obfuscators(job: VerticalJob, ref: TableRef, epochs: int) -> None:
    """Tell the party's in-memory pool how many obfuscators it draws in the job (waiting for
    the key holder's ``n``), so that its fixed-base table is sized for that once."""
    if epochs <= 0:
        return
    pool = _pool(job, ref, _public_key(job, ref))
    if isinstance(pool, ObfuscatorPool):
        pool.plan(obfuscators_needed(job, ref.party, epochs))


# ---- set-up -------------------------------------------------------------------------------
def prepare_key(job: VerticalJob, key_size: int) -> int:
    """Create the job's key pair unless it exists (ahead of the run, or at its start) and send
    ``n`` to every other party (the same bytes each time). Returns the modulus bits. Keys
    below 2048 bits need the key holder's own opt-in (``core.paillier.keys``)."""
    check_key_size(key_size)
    pair = job_key_pair(job)
    if pair.retired():
        get_run_logger().info("job %s has ended: its private key is deleted", job.job_id)
    n = pair.create(key_size, allow_insecure_key_size=small_keys_allowed())
    if n.bit_length() != key_size:
        raise VerticalSetupError(
            f"job {job.job_id} already has a {n.bit_length()}-bit key, not {key_size} bits: "
            "use the key size it was prepared with, or another job_id"
        )
    job.endpoint(job.key_holder).send_many(job.key_holder_peers, "public_key", n)
    return n.bit_length()


# the key holder's Paillier key pair, created once per job and kept in its store only
create_keys = task(name="vertical-keys", task_run_name="{job.key_holder}: key pair", **PARTY_STEP)(
    prepare_key
)


def keys_job(
    job_id: str,
    guest: str,
    hosts: tuple[str, ...],
    key_holder: str = "arbiter",
    key_holder_database: str = "",
    *,
    channel: Channel,
    randomizer: str = cipher.DEFAULT_RANDOMIZER,
    key_size: int = DEFAULT_KEY_BITS,
) -> VerticalJob:
    """The parts of a job that key and pool preparation need (the training options play no
    part; the schedule is a placeholder until :func:`agreed_job`)."""
    return VerticalJob(
        job_id=job_id,
        channel=channel,
        guest=guest,
        hosts=tuple(hosts),
        key_holder=key_holder,
        key_holder_database=key_holder_database,
        schedule=Schedule(2, 1, 0),
        learning_rate=0.0,
        momentum=0.0,
        decay=0.0,
        l2=0.0,
        randomizer=cipher.randomizer_mode(randomizer),
        key_size=key_size,
    )


def obfuscators_needed(job: VerticalJob, party: str, epochs: int = 1) -> int:
    """How many obfuscators ``party`` draws in ``epochs`` epochs of the agreed schedule: a host
    one per batch row plus its ``[[sum a^2]]`` and cross terms, the guest one per training row
    (the re-randomised ``[[d]]``) plus the loss; the hold-out check likewise (once per epoch)."""
    schedule = job.schedule
    rounds = epochs * schedule.batches_per_epoch
    train_rows = epochs * len(schedule.train_rows)
    checks = epochs if len(schedule.holdout_rows) else 0
    if party == job.guest:
        return train_rows + rounds + checks
    extra = 1 + job.hosts.index(party)  # the square and one cross term per earlier host
    return train_rows + checks * len(schedule.holdout_rows) + (rounds + checks) * extra


def prepare_pool(job: VerticalJob, ref: TableRef, count: int) -> int:
    """Fill the party's own pool with ``count`` obfuscators for the job's key (waiting for the
    key holder's ``n`` if it has not arrived), e.g. in idle time before a scheduled run.
    Returns how many the pool holds."""
    if ref.party not in (job.guest, *job.hosts):
        raise VerticalSetupError(f"{ref.party} encrypts nothing in job {job.job_id}")
    pool = cipher.party_pool(ref.database, _public_key(job, ref), job.randomizer, create=True)
    return cipher.fill_pool(pool, count)


@task(name="vertical-check", task_run_name="{ref.party}: check table", **PARTY_STEP)
def check_party(job: VerticalJob, ref: TableRef, role: str) -> dict[str, Any]:
    """Refuse bad inputs before any round; send the guest a digest of the aligned id order."""
    frame = PartyStore.of(ref).read_table(ref, allow_missing=True)  # imputed or refused below
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
    # the run's steps reuse this one read, preprocessed with the party's own statistics
    features = party_features(ref, job.clip_features, frame, job.preprocessing)
    encode_features(features.X, list(features.names))
    digest = id_order_digest(job.job_id, frame[ref.id_column])
    if ref.party != job.guest:
        job.endpoint(ref.party).send(job.guest, "id_order_digest", digest)
    else:
        _artifacts(ref.database).put(_key(job, "id_order_digest"), digest, "digest")
    return {"party": ref.party, "rows": len(frame), "features": features.X.shape[1]}


@task(name="vertical-aligned", task_run_name="{ref.party}: check alignment", **PARTY_STEP)
def check_alignment(job: VerticalJob, ref: TableRef) -> None:
    """The guest compares the hosts' id-order digests with its own (reveals only equal or not)."""
    own = _artifacts(ref.database).get(_key(job, "id_order_digest"))
    for host in job.hosts:
        theirs = job.endpoint(ref.party).receive(host, "id_order_digest")
        require_aligned(own, theirs, ref.party, host, VerticalSetupError)


# ---- one round ------------------------------------------------------------------------------
@task(
    name="vertical-host-share",
    task_run_name="r{round_} {phase} · {ref.party}: [[Xw/4]]",
    **PARTY_STEP,
)
def host_forward(job: VerticalJob, ref: TableRef, round_: int, phase: str = "train") -> None:
    """A host encrypts its score share for the batch and sends it to the guest and to later
    hosts; with several, ``sum(A^2)`` needs ``sum_i a_h a_h'``, so it folds its own share into
    each earlier host's encrypted share for the guest too."""
    X = _features(ref, job).X
    stored = _read_step(job, ref, round_, _weights_round(round_, phase), X.shape[1])
    rows = _rows(job, round_, phase)
    public = stored.public
    with _in_range(job, round_):
        share = host_share(X[rows], stored.weights)
    pool = _pool(job, ref, public)
    endpoint = job.endpoint(ref.party)
    # a re-run round (same weights, same plaintexts) re-sends the ciphertexts it sent before
    encrypted = endpoint.sent(job.guest, f"share_{phase}", round=round_)
    if encrypted is None:
        encrypted = cipher.encrypt(public, share, job.randomizer, pool=pool)
    later_hosts = job.hosts[job.hosts.index(ref.party) + 1 :]
    endpoint.send_many([job.guest, *later_hosts], f"share_{phase}", encrypted, round=round_)
    endpoint.send_once(
        job.guest,
        f"square_{phase}",
        lambda: cipher.encrypt(public, [sum(a * a for a in share)], job.randomizer, pool=pool),
        round=round_,
    )
    earlier_hosts = job.hosts[: job.hosts.index(ref.party)]
    for earlier in earlier_hosts[1:]:  # each folded as it comes: the rest fetched meanwhile
        prefetch(job, ref.party, earlier, f"share_{phase}", round_)
    for earlier in earlier_hosts:
        theirs = endpoint.receive(earlier, f"share_{phase}", round=round_)
        cross = cipher.weighted_sum(public, theirs, share)
        # re-randomised: a product of the guest's known ciphertexts would let it test guesses
        endpoint.send_once(
            job.guest,
            f"cross_{earlier}_{phase}",
            lambda cross=cross: cipher.rerandomize(public, [cross], job.randomizer, pool=pool),
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
    X, _, features = _matrix(ref, job, "guest")
    kinds = (f"loss_{phase}", "masked_gradient") if phase == "train" else (f"loss_{phase}",)
    stored = _read_step(job, ref, round_, _weights_round(round_, phase), X.shape[1], kinds)
    weights = stored.weights
    rows = _rows(job, round_, phase)
    y = labels_pm1(features.labels[rows])
    public = stored.public
    endpoint = job.endpoint(ref.party)
    if stored.sent[kinds[0]] is None:  # while the hosts encrypt: [[d]]'s and the loss's
        obfuscators_ahead(job, ref, len(rows) + 1 if phase == "train" else 1)
    hosts = len(job.hosts)
    crosses = [(h, f"cross_{e}_{phase}") for i, h in enumerate(job.hosts) for e in job.hosts[:i]]
    wanted = [(h, f"{kind}_{phase}") for kind in ("share", "square") for h in job.hosts]
    received = _collect_all(job, ref.party, ref.database, [*wanted, *crosses], round_)
    total = functools.reduce(functools.partial(cipher.add, public), received[:hosts])
    loss_terms = [square[0] for square in received[hosts : 2 * hosts]]
    loss_terms += [cipher.weighted_sum(public, [cross[0]], [2]) for cross in received[2 * hosts :]]
    with _in_range(job, round_):
        b, q = guest_shares(X[rows], weights, y)
    coefficients, constant = loss_coefficients(q, y)
    pool = _pool(job, ref, public)

    def encrypted_loss() -> dict[str, Any]:
        loss = cipher.weighted_sum(
            public, [*total, *loss_terms], [*coefficients, *[1] * len(loss_terms)]
        )
        loss = cipher.add_plain(public, [loss], [constant])
        return {"message": cipher.rerandomize(public, loss, job.randomizer, pool=pool)}

    _deliver_once(job, ref, f"loss_{phase}", round_, encrypted_loss, stored.sent[kinds[0]])
    if phase != "train":
        return
    residual = cipher.add_plain(public, total, b)
    # one re-randomisation serves every host: it unlinks [[d]] from each host's own shares
    sent = (endpoint.sent(host, "residual", round=round_) for host in job.hosts)
    fresh = next((message for message in sent if message is not None), None)
    if fresh is None:
        fresh = cipher.rerandomize(public, residual, job.randomizer, pool=pool)
    endpoint.send_many(job.hosts, "residual", fresh, round=round_)
    _mask_and_send(job, ref, stored, X[rows], residual, round_)


PACK_GRADIENTS = True  # False: one ciphertext per gradient entry (benchmarks compare both)


def gradient_layout(job: VerticalJob, n: int) -> packing.Layout | None:
    """How masked gradients share plaintexts in this job (None: one entry per ciphertext).
    Public: the key's size, the batch size and the host count fix it, so the key holder
    knows every party's packed length."""
    if not PACK_GRADIENTS:
        return None
    return packing.layout(int(n).bit_length(), job.schedule.batch_size, len(job.hosts))


def _mask_and_send(
    job: VerticalJob,
    ref: TableRef,
    stored: StepInputs,
    X: np.ndarray,
    residual: list[int],
    round_: int,
) -> None:
    """``[[X^T d + r]]`` to the key holder, packed several entries to a ciphertext where the
    layout allows (:func:`gradient_layout`); the masks ``r`` stay in the party's store."""
    public = stored.public

    def masked_gradient() -> dict[str, Any]:
        gradient = cipher.transpose_dot(public, encode_features(X), residual)
        layout = gradient_layout(job, public.n)
        if layout is None:
            masks = cipher.random_masks(len(gradient))
            return {"message": cipher.add_plain(public, gradient, masks), "masks": masks}
        masks = layout.masks(len(gradient))
        packed = cipher.pack(public, gradient, layout.slot_bits, layout.slots)
        message = cipher.add_plain(public, packed, layout.packed_masks(masks))
        return {"message": message, "masks": masks, "layout": asdict(layout)}

    _deliver_once(
        job, ref, "masked_gradient", round_, masked_gradient, stored.sent["masked_gradient"]
    )


@task(
    name="vertical-host-gradient",
    task_run_name="r{round_} · {ref.party}: [[X^T d]] + mask",
    **PARTY_STEP,
)
def host_gradient(job: VerticalJob, ref: TableRef, round_: int) -> None:
    X = _features(ref, job).X
    rows = _rows(job, round_, "train")
    residual = job.endpoint(ref.party).receive(job.guest, "residual", round=round_)
    stored = _read_step(job, ref, round_, sent=("masked_gradient",))
    _mask_and_send(job, ref, stored, X[rows], residual, round_)


@task(
    name="vertical-decrypt",
    task_run_name="r{round_} {phase} · {job.key_holder}: decrypt",
    **PARTY_STEP,
)
def key_holder_decrypt(job: VerticalJob, round_: int, phase: str = "train") -> float:
    """Decrypt the loss (a public training metric) and the *masked* gradients, and return each
    masked gradient to its owner. Every message is received before the key holder's database
    is opened (waiting for late peers holds no database)."""
    db = job.key_holder_database
    kind = f"loss_{phase}"
    senders = (job.guest, *job.hosts) if phase == "train" else ()
    wanted = [(job.guest, kind), *((p, "masked_gradient") for p in senders)]
    encrypted_loss, *gradients = _collect_all(job, job.key_holder, db, wanted, round_)
    masked = dict(zip(senders, gradients, strict=True))
    with PartyStore(db).session():
        private = job_key_pair(job).private()
        if private is None:
            raise KeyHolderRefusalError(
                f"job {job.job_id} has ended and {job.key_holder} deleted its private key; "
                "training cannot continue in this job: start a new job (another job_id)"
            )
        n_rows = len(_rows(job, round_, phase))
        total = _decrypt_once(job, private, job.guest, kind, round_, encrypted_loss, 1)[0]
        loss = decode_loss(total, n_rows)
        layout = gradient_layout(job, private.public_key.n)
        for party in senders:  # each masked gradient has its agreed width, packed
            width = job.width(party)
            length = width if layout is None else layout.packed_length(width)
            plain = _decrypt_once(
                job, private, party, "masked_gradient", round_, masked[party], length
            )
            _deliver(job, job.key_holder, db, party, "masked_gradient_plain", plain, round_)
    return loss


@task(name="vertical-retire-key", task_run_name="{job.key_holder}: delete p, q", **PARTY_STEP)
def retire_key(job: VerticalJob) -> None:
    """The job is over: the key holder keeps only ``n`` (to recognise the job); p, q and the
    decryption records go, and the job's key file is shredded (:meth:`JobKeyPair.retire`)."""
    job_key_pair(job).retire("decrypted")


@task(
    name="vertical-update", task_run_name="r{round_} · {ref.party}: unmask and update", **PARTY_STEP
)
def update_weights(job: VerticalJob, ref: TableRef, round_: int, role: str) -> float:
    """Remove the mask, take the optimizer step, checkpoint the round. Returns the squared
    norm of this party's gradient (for the round table)."""
    X, _, _ = _matrix(ref, job, role)
    penalised = np.ones(X.shape[1])
    if role == "guest":
        penalised[0] = 0.0  # the intercept
    masked = _collect(job, ref.party, ref.database, job.key_holder, "masked_gradient_plain", round_)
    store = PartyStore.of(ref)
    with store.session():  # received first: waiting for the key holder holds no database
        state = _state(job, ref, round_ - 1, X.shape[1])
        sent = _artifacts(ref.database).get(_sent_key(job, "masked_gradient", round_))
        gradient_sum = _unmask(masked, sent)
        optimizer = job.optimizer(state["velocity"])
        epoch, _ = job.schedule.position(round_)
        rows = len(_rows(job, round_, "train"))
        weights = optimizer.step(ref.party, state["weights"], gradient_sum, rows, epoch, penalised)
        gradient = decode_gradient(gradient_sum, rows) + job.l2 * state["weights"] * penalised
        checkpoints = RoundCheckpoints(store, PROTOCOL, job.job_id)
        # the round's checkpoint and the clean-up it allows: one transaction, all or nothing
        with store.transaction() as con:
            checkpoints.save(round_, {"weights": weights, "velocity": optimizer.velocity}, con)
            checkpoints.prune(keep_last=KEEP_ROUNDS, con=con)
            _forget_sent(job, ref, round_, con)
    return float(np.sum(gradient**2))


def _unmask(masked: list[int], sent: dict[str, Any]) -> list[int]:
    """``X^T d`` from the key holder's decryption and the masks the party kept."""
    if sent.get("layout") is None:
        return [m - r for m, r in zip(masked, sent["masks"], strict=True)]
    return packing.Layout(**sent["layout"]).unpack(masked, sent["masks"])


# ---- resume, model, scoring ------------------------------------------------------------------
@task(name="vertical-last-round", task_run_name="{ref.party}: last finished round", **PARTY_STEP)
def last_round(job: VerticalJob, ref: TableRef) -> int:
    return RoundCheckpoints(PartyStore.of(ref), PROTOCOL, job.job_id).last_round()


@task(name="vertical-save-model", task_run_name="{ref.party}: save model share", **PARTY_STEP)
def save_model(job: VerticalJob, ref: TableRef, round_: int, role: str) -> dict[str, Any]:
    """Store this party's share of the model (its features' coefficients; the intercept at the
    guest) in its own database, with the ids it trained on and held out."""
    X, names, fitted = _matrix(ref, job, role)
    artifacts = _artifacts(ref.database)
    key = model_key(PROTOCOL, job.job_id, ref.party)
    with artifacts.store.session():
        weights = np.asarray(_state(job, ref, round_, X.shape[1])["weights"], dtype=np.float64)
        train, held_out = job.schedule.train_rows, job.schedule.holdout_rows
        guest = role == "guest"
        model = ModelRecord.linear(
            "vertical",
            job.job_id,
            names[1:] if guest else names,  # the guest's first column is the intercept's
            weights[1:] if guest else weights,
            float(weights[0]) if guest else None,
            party=ref.party,
            share=True,
            preprocessing=None if fitted.preprocessing is None else fitted.preprocessing.to_dict(),
            clip=job.clip_features,
            rows={"train": int(train.size), "held_out": int(held_out.size)},
            extras={"round": round_, "role": role},
            **provenance(ref),
        )
        ids = np.asarray(fitted.ids, dtype=object)
        with artifacts.store.transaction() as con:
            ModelStore(artifacts.store).save(key, model, ids[train], ids[held_out], con)
            artifacts.delete_prefix(_key(job, "sent"), con=con)  # masks are no longer needed
        n = artifacts.get(_key(job, "public_key"))
    if n is not None:  # the key retires with the job: its leftover obfuscators go too
        discard_pool(pool_path(ref.database, int(n), job.randomizer))
        cipher.forget_ahead(ref.party, int(n))
    return {"key": key, "coefficients": dict(zip(names, weights.tolist(), strict=True))}


def _share_weights(model: dict[str, Any]) -> np.ndarray:
    """A saved share as the training's weight vector (the guest's starts with the intercept)."""
    record = ModelRecord.from_dict(model)
    head = [] if record.intercept is None else [record.intercept]
    return np.array([*head, *record.coefficients], dtype=np.float64)


@task(name="vertical-host-scores", task_run_name="{ref.party}: scores for the guest", **PARTY_STEP)
def host_scores(job: VerticalJob, ref: TableRef) -> None:
    """Scoring: a host sends the guest its plaintext score share ``X_h w_h`` (as FATE's
    predict does); the guest learns these sums, never the host's features or weights."""
    scores = _features(ref, job).X @ _share_weights(_saved_model(job, ref))
    job.endpoint(ref.party).send(job.guest, "scores", scores, round=0)


@task(
    name="vertical-guest-predict", task_run_name="{ref.party}: predict and evaluate", **PARTY_STEP
)
def guest_predict(job: VerticalJob, ref: TableRef) -> dict[str, Any]:
    """The guest's probabilities for every aligned row, stored in its database, and metrics."""
    X, _, features = _matrix(ref, job, "guest")
    labels = features.labels
    scores = X @ _share_weights(_saved_model(job, ref))
    wanted = [(host, "scores") for host in job.hosts]
    for shares in _collect_all(job, ref.party, ref.database, wanted, 0):
        scores = scores + shares
    probabilities = 1.0 / (1.0 + np.exp(-scores))
    frame = pd.DataFrame({ref.id_column: features.ids, "probability": probabilities})
    PartyStore.of(ref).write_table(f"{ref.table}_scores", frame)
    metrics = {}
    rate = float(np.clip(labels[job.schedule.train_rows].mean(), 1e-6, 1 - 1e-6))  # the prior
    for name, rows in (("train", job.schedule.train_rows), ("holdout", job.schedule.holdout_rows)):
        if len(rows) and len(set(labels[rows])) == 2:
            metrics[f"{name}_auc"] = exact_auc(labels[rows], probabilities[rows])
            metrics[f"{name}_log_loss"] = log_loss(labels[rows], probabilities[rows])
            prior = np.full(len(rows), rate)
            metrics[f"{name}_prior_log_loss"] = log_loss(labels[rows], prior)
    return {
        "metrics": metrics,
        "scores_table": f"{ref.table}_scores",
        "probabilities": probabilities,
    }


# ---- set-up facts from peers (deterministic: a restarted party re-sends identical bytes) ----
def agreed_job(
    job: VerticalJob,
    rows: int,
    widths: dict[str, int],
    batch_size: int,
    holdout_fraction: float,
) -> VerticalJob:
    """The job with the public schedule and the gradient lengths every party agreed on."""
    schedule = Schedule(rows, min(batch_size, rows), job.schedule.seed, holdout_fraction)
    return replace(job, schedule=schedule, widths=tuple(widths.items()))


@task(
    name="vertical-announce", task_run_name="{ref.party}: feature count to the guest", **PARTY_STEP
)
def host_announce(job: VerticalJob, ref: TableRef, features: int) -> None:
    """A host tells the guest how many features it trains on (for the batch-size check)."""
    job.endpoint(ref.party).send(job.guest, "features", int(features))


@task(name="vertical-agree", task_run_name="{ref.party}: agree on the set-up", **PARTY_STEP)
def guest_agree(
    job: VerticalJob, ref: TableRef, info: dict[str, Any], batch_size: int, holdout_fraction: float
) -> VerticalJob:
    """The guest collects the hosts' feature counts, refuses batches that would leak its labels,
    and sends the hosts the row count and the key holder the gradient lengths."""
    endpoint = job.endpoint(ref.party)
    host_features = {host: int(endpoint.receive(host, "features")) for host in job.hosts}
    widths = {ref.party: info["features"] + 1, **host_features}
    agreed = agreed_job(job, info["rows"], widths, batch_size, holdout_fraction)
    check_batches(agreed.schedule, host_features)
    endpoint.send_many(job.hosts, "setup", {"rows": info["rows"]})
    if job.with_arbiter:
        endpoint.send(job.key_holder, "setup", {"rows": info["rows"], "widths": widths})
    return agreed


@task(name="vertical-setup", task_run_name="{party}: set-up from the guest", **PARTY_STEP)
def receive_setup(
    job: VerticalJob, party: str, batch_size: int, holdout_fraction: float
) -> VerticalJob:
    """A host or the arbiter takes the row count (and gradient lengths) the guest agreed."""
    setup = job.endpoint(party).receive(job.guest, "setup")
    widths = {str(k): int(v) for k, v in setup.get("widths", {}).items()}
    return agreed_job(job, int(setup["rows"]), widths, batch_size, holdout_fraction)


@task(
    name="vertical-share-loss", task_run_name="r{round_} {phase} · loss to the guest", **PARTY_STEP
)
def share_loss(job: VerticalJob, round_: int, phase: str, loss: float) -> None:
    """The key holder records a decrypted loss (its stop decisions read it) and tells the guest."""
    db = job.key_holder_database
    _artifacts(db).put(_loss_key(job, phase, round_), loss, "metric")
    _deliver(job, job.key_holder, db, job.guest, f"loss_value_{phase}", loss, round_)


@task(
    name="vertical-guest-loss", task_run_name="r{round_} {phase} · {ref.party}: loss", **PARTY_STEP
)
def guest_loss(
    job: VerticalJob, ref: TableRef, round_: int, phase: str, metrics: dict[str, float]
) -> float:
    """The guest's record of a round (loss from the key holder, its own metrics; a held-out
    loss, at an epoch's end, for the rounds table and the loss chart), stored together: what
    early stopping and the round history read."""
    loss = _collect(job, ref.party, ref.database, job.key_holder, f"loss_value_{phase}", round_)
    artifacts = _artifacts(ref.database)
    with artifacts.store.transaction() as con:
        artifacts.put(_loss_key(job, phase, round_), loss, "metric", con=con)
        if phase == "train":
            artifacts.put(_key(job, "round-metrics", f"{round_:07d}"), metrics, "metric", con=con)
    return float(loss)


# where each phase's loss is stored (the training loss is the key holder's round checkpoint)
_LOSS_KINDS = {"train": "loss", "holdout": "holdout-loss"}


def _loss_key(job: VerticalJob, phase: str, round_: int) -> str:
    return _key(job, _LOSS_KINDS[phase], f"{round_:07d}")


def stored_losses(job: VerticalJob, database: str) -> dict[int, float]:
    """Every finished round's training loss recorded in ``database`` (earlier runs' too)."""
    artifacts = _artifacts(database)
    prefix = _key(job, "loss", "")
    with artifacts.store.session():
        return {int(k.rsplit("/", 1)[1]): artifacts.get(k) for k, *_ in artifacts.list(prefix)}


def round_losses(job: VerticalJob, database: str, *rounds: int) -> list[float | None]:
    """The training losses of ``rounds`` recorded in ``database`` (None: not recorded), read
    in one session: a round's divergence check needs two, not every round's."""
    artifacts = _artifacts(database)
    with artifacts.store.session():
        return [artifacts.get(_loss_key(job, "train", r)) for r in rounds]


def epoch_loss(losses: dict[int, float], epoch: int, batches: int) -> float | None:
    """Mean training loss of an epoch from the stored per-round losses (None if incomplete),
    so early stopping decides the same way in a resumed run as in an uninterrupted one."""
    rounds = range(epoch * batches, (epoch + 1) * batches)
    if epoch < 0 or any(r not in losses for r in rounds):
        return None
    return sum(losses[r] for r in rounds) / batches


def key_holder_last_round(job: VerticalJob) -> int:
    """The last round whose loss the key holder recorded (its round checkpoint)."""
    return max(stored_losses(job, job.key_holder_database), default=-1)


def stopped_at(job: VerticalJob) -> int | None:
    return _artifacts(job.key_holder_database).get(_key(job, "stopped"))


@task(
    name="vertical-decide-stop", task_run_name="r{round_} · {job.key_holder}: stop?", **PARTY_STEP
)
def decide_stop(job: VerticalJob, round_: int, tol: float, tell: bool = False) -> bool:
    """After an epoch's last round: stop once its mean loss changed by less than ``tol``.
    With ``tell`` the decision goes to every other party (each waits for it)."""
    with PartyStore(job.key_holder_database).session():
        losses = stored_losses(job, job.key_holder_database)
        epoch, _ = job.schedule.position(round_)
        batches = job.schedule.batches_per_epoch
        now, previous = epoch_loss(losses, epoch, batches), epoch_loss(losses, epoch - 1, batches)
        stop = previous is not None and now is not None and abs(previous - now) < tol
        if stop:
            _artifacts(job.key_holder_database).put(_key(job, "stopped"), round_, "marker")
            get_run_logger().info("converged after epoch %d (loss change < %g)", epoch, tol)
    for party in job.key_holder_peers if tell else ():
        job.endpoint(job.key_holder).send_once(party, "stop", lambda: stop, round=round_)
    return stop


@task(name="vertical-stop-decision", task_run_name="r{round_} · {party}: stop?", **PARTY_STEP)
def receive_stop(job: VerticalJob, party: str, round_: int) -> bool:
    return bool(job.endpoint(party).receive(job.key_holder, "stop", round=round_))


def model_round(job: VerticalJob, ref: TableRef) -> int | None:
    """The round of the party's saved model slice, or None while the job trains."""
    model = _saved_model(job, ref)
    return None if model is None else int(model["round"])
