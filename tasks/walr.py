"""WALR tasks, one per party step: thin wrappers over core.walr and the integer Paillier cipher.

More (the protocol, what each party learns, why): docs/protocols/walr.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
from phe import paillier
from prefect import get_run_logger, task

from core.dp.accounting import DiscreteGaussian, Event
from core.dp.errors import PrivacyParameterError
from core.dp.gaussian import analytic_gaussian_sigma, classic_gaussian_sigma
from core.ids import id_order_digest, require_aligned
from core.model_format import ModelRecord
from core.paillier import cipher
from core.paillier.errors import PaillierError
from core.paillier.keys import (
    DEFAULT_KEY_BITS,
    check_key_size,
    check_peer_modulus,
    small_keys_allowed,
)
from core.preprocessing import FittedPreprocessing, PreprocessingSpec, fit_local
from core.walr import (
    PrivacyWarning,
    WalrFeatures,
    WalrFit,
    default_granularity,
    fit_walr,
    prepare_binary_features,
    prepare_clipped_features,
    release_noise,
    validate_labels,
    walr_sigma,
)
from federation.channel import Channel, PartyEndpoint
from storage import codec, models
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from storage.secrets import JobKeyPair
from tasks import secure_sum
from tasks.loading import fingerprint
from tasks.policy import PARTY_STEP
from tasks.reporting import provenance
from tasks.summaries import classifier_figures, holdout_split, log_figures

PROTOCOL = "walr"
MODES = ("binary", "clipped")
_EXACT_FLOAT_INT = 2**53


class WalrSetupError(ValueError):
    """The parties' inputs or the flow's options cannot give a WALR release."""


@dataclass(frozen=True)
class WalrJob:
    """Everything a party step needs besides its own table: small and public."""

    job_id: str
    channel: Channel = field(compare=False, repr=False)  # this side's, built once by its flow
    features_party: str
    labels_party: str
    epsilon: float
    delta: float
    mode: str
    clip_norm: float | None
    protected_table: str
    labels_fingerprint: str
    features_fingerprint: str
    noise: bool = True
    noiseless_for_tests: bool = False
    # the features party's column count, agreed at set-up: the labels party decrypts exactly
    # columns + 1 sums (with the intercept), once
    columns: int | None = None
    randomizer: str = cipher.DEFAULT_RANDOMIZER
    holdout_fraction: float = 0.0  # share of rows kept out of the release, to evaluate on
    # the labels party's key as the job's terms state it: the features party checks the n it
    # receives against it before encrypting anything (core.paillier.keys.check_peer_modulus)
    key_size: int = DEFAULT_KEY_BITS
    # the features party's own preprocessing (fitted on its training rows, applied before the
    # grid encoding); the labels party never uses it
    preprocessing: PreprocessingSpec = field(default_factory=PreprocessingSpec)

    def split(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """``(training rows, held-out rows)``: both parties derive them from public values."""
        return holdout_split(rows, self.holdout_fraction, PROTOCOL)

    def endpoint(self, party: str) -> PartyEndpoint:
        return self.channel.endpoint(party)

    def key(self, *parts: object) -> str:
        return "/".join([PROTOCOL, self.job_id, *map(str, parts)])

    def key_pair(self, ref: TableRef) -> JobKeyPair:
        """The labels party's key pair for this job: p, q sealed under a key file shredded
        when the release is sent."""
        return JobKeyPair(PartyStore.of(ref), self.key())

    @property
    def release_key(self) -> str:
        """Same data, same release parameters: same key, so the ledger charges once."""
        inputs = {
            "labels": self.labels_fingerprint,
            "features": self.features_fingerprint,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "mode": self.mode,
            "clip_norm": self.clip_norm,
            "noise": self.noise,
        }
        if self.holdout_fraction:  # the sum covers other rows: another release
            inputs["holdout_fraction"] = self.holdout_fraction
        text = json.dumps(inputs, sort_keys=True)
        return f"walr-{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    @property
    def mechanism(self) -> str:
        return "walr-discrete-gaussian" if self.noise else "walr-no-noise-testing"


@dataclass(frozen=True)
class FeaturesFacts:
    """What the features party tells the labels party at set-up: public, no feature value.

    The column count fixes how many sums the labels party decrypts; mode and clip norm fix
    the sensitivity it calibrates to; the salted fingerprint (it reveals only "changed or
    not") names the features in the release key, so unchanged inputs reuse a release.
    """

    columns: int
    mode: str
    clip_norm: float | None
    fingerprint: str
    holdout_fraction: float = 0.0

    def as_message(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_message(cls, message: Any, sender: str) -> FeaturesFacts:
        try:
            facts = cls(**message)
        except TypeError:  # not a mapping, or other fields than these
            raise WalrSetupError(f"the features facts of {sender} are not readable") from None
        if isinstance(facts.columns, bool) or not isinstance(facts.columns, int):
            raise WalrSetupError(f"{sender} sent a column count that is not an integer")
        if facts.columns < 1 or not isinstance(facts.fingerprint, str):
            raise WalrSetupError(f"{sender} sent {facts.columns} columns or no fingerprint")
        return facts


def labels_only(ref: TableRef) -> TableRef:
    """The labels party's view for WALR: the id and label columns, none of its features."""
    if ref.label_column is None:
        raise WalrSetupError(f"labels table {ref.table!r} of {ref.party} has no label_column")
    return replace(ref, feature_columns=())


def _labels(ref: TableRef) -> tuple[list[object], np.ndarray]:
    frame = PartyStore.of(ref).read_table(labels_only(ref))
    return frame[ref.id_column].tolist(), validate_labels(frame[ref.label_column])


def effective_spec(spec: PreprocessingSpec, mode: str) -> PreprocessingSpec:
    """Binary mode's 0/1 columns are never scaled (its sensitivity counts ones); imputation
    and the declared missing values still apply."""
    return replace(spec, scaling="none") if mode == "binary" else spec


def features_fingerprint(ref: TableRef, spec: PreprocessingSpec) -> str:
    """The table's salted fingerprint joined with the preprocessing asked for: another
    transform makes another sum, so it must not reuse a stored release."""
    text = json.dumps([fingerprint(ref), spec.to_dict()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _features(
    job: WalrJob, ref: TableRef
) -> tuple[list[object], WalrFeatures, FittedPreprocessing]:
    """The features party's rows, preprocessed with statistics of its own training rows
    (nothing leaves the party), then clipped and grid-encoded, or checked to be 0/1."""
    frame = PartyStore.of(ref).read_table(ref, allow_missing=True)
    names = [c for c in frame.columns if c != ref.id_column]
    raw = frame[names].to_numpy(dtype=float)
    train = job.split(len(raw))[0]
    fitted = fit_local(raw[train], names, effective_spec(job.preprocessing, job.mode))
    columns = pd.DataFrame(
        fitted.transform(raw, f"party {ref.party}, table {ref.table!r}"),
        columns=fitted.output_names,
    )
    ids = frame[ref.id_column].tolist()
    if job.mode == "binary":
        return ids, prepare_binary_features(columns), fitted
    return ids, prepare_clipped_features(columns, job.clip_norm), fitted


def public_shape(mode: str, rows: int, columns: int, clip_norm: float | None) -> WalrFeatures:
    """What the labels party knows of the features (N, k, mode, clip norm), for calibration.

    ``walr_sigma`` reads only these public facts, so the labels party calibrates its own noise
    from them instead of trusting a sigma chosen by the features party. The values are a
    zero-copy placeholder of the right shape.
    """
    binary = mode == "binary"
    return WalrFeatures(
        values=np.broadcast_to(np.float64(0.0), (rows, columns)),
        column_names=tuple(f"x{j}" for j in range(columns)),
        granularity=1.0 if binary else default_granularity(float(clip_norm)),
        row_norm_bound=math.sqrt(columns) if binary else float(clip_norm),
        fit_intercept=True,
        mode="binary" if binary else "clipped",
    )


def model_key(job_id: str) -> str:
    return models.model_key("walr", job_id)


def _mask_key(job_id: str, mask_id: str) -> str:
    """Where the features party keeps the mask of the sums it sent with ``mask_id``."""
    return "/".join([PROTOCOL, job_id, "mask", mask_id])


class ReleaseRefusalError(ValueError):
    """The labels party refused to decrypt or release (the offending party is named)."""


def _budget_table(job: WalrJob, ref: TableRef) -> str:
    """The labels party charges its own source table, whatever name the caller passed, and
    releases without noise only with the owner's consent.

    ``job.protected_table`` may name the labels table or its source; anything else is refused,
    so no caller can point the charge at another table's budget.
    """
    ledger = PrivacyLedger(PartyStore.of(ref))
    own = ledger.budget_table(ref.table)
    if ledger.budget_table(job.protected_table) != own:
        raise ReleaseRefusalError(
            f"{ref.party} charges releases of {ref.table!r} to its source table {own!r}; "
            f"refusing protected_table={job.protected_table!r}"
        )
    if not job.noise:
        what = "a release without noise (noise=False)"
        OwnerPolicy(ledger.store).require(ref.party, ref.table, "allow_noiseless_release", what)
    return own


def _release_event(job: WalrJob, rows: int) -> Event | None:
    """The release's event for the ledger, from public facts: discrete Gaussian noise in grid
    steps; one label moves a binary sum by 0 or 1 step per coordinate (exact accounting), a
    clipped one by an integer vector (its fine grid counts as continuous). None (the nominal
    pair) without noise or before the columns are agreed (the release then refuses)."""
    if not job.noise or job.columns is None:
        return None
    shape = public_shape(job.mode, len(job.split(rows)[0]), job.columns, job.clip_norm)
    with warnings.catch_warnings():  # walr_sigma's delta >= 1/N warning comes with the release
        warnings.simplefilter("ignore", PrivacyWarning)
        steps = walr_sigma(job.epsilon, job.delta, shape) / shape.granularity
    shift = "unit" if shape.mode == "binary" else "vector"
    return DiscreteGaussian(shape.sensitivity / shape.granularity, steps, shift)


# ---- checks (local, before any message) -----------------------------------------------------
@task(name="walr-labels-check", task_run_name="{ref.party}: labels and budget", **PARTY_STEP)
def check_labels_and_budget(job: WalrJob, ref: TableRef) -> dict[str, Any]:
    """Refuse bad labels, options the owner does not allow, and a release the budget cannot
    pay for, before anything is computed.

    A release already stored under this job's release key is reused and needs no budget.
    """
    _, labels = _labels(ref)
    table = _budget_table(job, ref)
    ledger = PrivacyLedger(PartyStore.of(ref))
    reused = ledger.stored_release(job.release_key) is not None
    if not reused:
        event = _release_event(job, labels.size)
        ledger.require_affordable(table, job.epsilon, job.delta, event=event)
    return {"rows": int(labels.size), "reused": reused}


@task(name="walr-features-check", task_run_name="{ref.party}: features and id order", **PARTY_STEP)
def check_features(job: WalrJob, ref: TableRef) -> dict[str, Any]:
    """Refuse features that break the declared sensitivity; send the id-order digest."""
    if ref.label_column is not None:
        raise WalrSetupError(
            f"features table {ref.table!r} of {ref.party} declares label column "
            f"{ref.label_column!r}: in WALR only the labels party holds labels"
        )
    ids, features, _ = _features(job, ref)
    endpoint = job.endpoint(ref.party)
    endpoint.send(job.labels_party, "id_order_digest", id_order_digest(job.job_id, ids))
    facts = FeaturesFacts(
        len(features.column_names),
        job.mode,
        job.clip_norm,
        job.features_fingerprint,
        job.holdout_fraction,
    )
    endpoint.send(job.labels_party, "walr_features", facts.as_message())
    return {
        "rows": features.n_rows,
        "columns": len(features.column_names),
        "sensitivity": features.sensitivity,
        "granularity": features.granularity,
    }


@task(name="walr-features-facts", task_run_name="{ref.party}: the features' shape", **PARTY_STEP)
def receive_features_facts(job: WalrJob, ref: TableRef) -> dict[str, Any]:
    """The labels party learns the column count it will decrypt and the features' salted
    fingerprint its release key names; a features party calibrated differently is refused.

    The id-order digest, sent with the facts, is fetched beside them: the alignment check
    then reads it locally instead of asking after the budget check."""
    endpoint = job.endpoint(ref.party)
    secure_sum.prefetch(endpoint, job.features_party, "id_order_digest")
    message = endpoint.receive(job.features_party, "walr_features")
    facts = FeaturesFacts.from_message(message, job.features_party)
    if (facts.mode, facts.clip_norm) != (job.mode, job.clip_norm):
        raise WalrSetupError(
            f"{job.features_party} prepares its features in mode {facts.mode!r} with clip norm "
            f"{facts.clip_norm!r}; {ref.party} calibrates for mode {job.mode!r} with clip norm "
            f"{job.clip_norm!r}: the parties must agree on both"
        )
    if facts.holdout_fraction != job.holdout_fraction:
        raise WalrSetupError(
            f"{job.features_party} holds out a share {facts.holdout_fraction!r} of the rows, "
            f"{ref.party} {job.holdout_fraction!r}: the parties must agree on the hold-out"
        )
    return {"columns": facts.columns, "features_fingerprint": facts.fingerprint}


@task(name="walr-aligned", task_run_name="{ref.party}: check alignment", **PARTY_STEP)
def check_alignment(job: WalrJob, ref: TableRef) -> None:
    """The labels party compares digests (learns only equal or not)."""
    ids, _ = _labels(ref)
    theirs = job.endpoint(ref.party).receive(job.features_party, "id_order_digest")
    own = id_order_digest(job.job_id, ids)
    require_aligned(own, theirs, ref.party, job.features_party, WalrSetupError)


# ---- the one-shot release ---------------------------------------------------------------------
@task(name="walr-plan", task_run_name="{ref.party}: new or stored release", **PARTY_STEP)
def send_plan(job: WalrJob, ref: TableRef, reused: bool) -> bool:
    """Tell the features party whether a new release is made (it then masks its sums) or a
    stored one is re-sent. Sent once per job: a re-run keeps the first answer, which stays
    true (a release stored since was made from this job's or an earlier job's sums)."""
    endpoint = job.endpoint(ref.party)
    endpoint.send_once(job.features_party, "walr_plan", lambda: {"new_release": not reused})
    return bool(endpoint.sent(job.features_party, "walr_plan")["new_release"])


@task(name="walr-plan-received", task_run_name="{ref.party}: new or stored release", **PARTY_STEP)
def receive_plan(job: WalrJob, ref: TableRef) -> bool:
    """``True`` when the labels party makes a new release and waits for the masked sums."""
    plan = job.endpoint(ref.party).receive(job.labels_party, "walr_plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("new_release"), bool):
        raise WalrSetupError(f"{ref.party} got no readable release plan from {job.labels_party}")
    return plan["new_release"]


@task(name="walr-encrypt-labels", task_run_name="{ref.party}: key pair and [[y]]", **PARTY_STEP)
def encrypt_labels(job: WalrJob, ref: TableRef) -> int:
    """The labels party's own key pair (of the job's key size, kept in its store only) and its
    encrypted labels."""
    check_key_size(job.key_size)
    n = job.key_pair(ref).create(job.key_size, allow_insecure_key_size=small_keys_allowed())
    _, labels = _labels(ref)
    labels = labels[job.split(labels.size)[0]]  # held-out rows stay out of the sum
    # Its own key: the same obfuscators, computed modulo p^2 and q^2 (CRT).
    private = _private_key(job, ref)
    public = private.public_key
    endpoint = job.endpoint(ref.party)
    endpoint.send(job.features_party, "walr_public_key", n)  # stored: the same bytes
    # fresh obfuscators each time: a re-run keeps the ciphertexts already sent
    endpoint.send_once(
        job.features_party,
        "walr_encrypted_labels",
        lambda: cipher.encrypt(public, labels.tolist(), job.randomizer, private=private),
    )
    get_run_logger().info("%s encrypted the labels of %d training rows", ref.party, labels.size)
    return n.bit_length()


@task(name="walr-masked-sums", task_run_name="{ref.party}: [[X^T y]] + mask", **PARTY_STEP)
def masked_sums(job: WalrJob, ref: TableRef) -> int:
    """``[[X^T y + r]]`` on the exact integer grid; the mask ``r`` stays in this party's store.

    Each masking gets a fresh random id stored with ``r`` before the sums are sent; the id
    travels with the sums, so a release stored by the labels party always finds the mask it
    was made with. Sent once per job: a re-run keeps the sums (and mask) already sent.
    """
    endpoint = job.endpoint(ref.party)
    _, features, _ = _features(job, ref)
    units = features.grid_units()[job.split(features.n_rows)[0]]

    def masked() -> dict[str, Any]:
        key = check_peer_modulus(
            endpoint.receive(job.labels_party, "walr_public_key"),
            expected_bits=job.key_size,
            allow_insecure_key_size=small_keys_allowed(),  # this party's own opt-in
            holder=job.labels_party,
        )
        public = paillier.PaillierPublicKey(key)
        encrypted = endpoint.receive(job.labels_party, "walr_encrypted_labels")
        if len(encrypted) != len(units):
            raise WalrSetupError(
                f"got {len(encrypted)} encrypted labels for {len(units)} training rows"
            )
        sums = cipher.transpose_dot(public, units, encrypted)
        masks = cipher.random_masks(len(sums))
        mask_id = secrets.token_hex(16)
        ArtifactStore(PartyStore.of(ref)).put(_mask_key(job.job_id, mask_id), masks, "secret")
        hidden = cipher.rerandomize(public, cipher.add_plain(public, sums, masks), job.randomizer)
        return {"mask_id": mask_id, "sums": hidden}

    endpoint.send_once(job.labels_party, "walr_masked_sums", masked)
    return len(features.column_names) + 1


def _private_key(job: WalrJob, ref: TableRef) -> paillier.PaillierPrivateKey:
    """The labels party's own key pair of this job; refused once the job retired it."""
    private = job.key_pair(ref).private()
    if private is None:
        raise ReleaseRefusalError(
            f"{ref.party} has no private key for job {job.job_id} (never created, or deleted "
            "when the job's release was sent): start a new job"
        )
    return private


def _noise_units(job: WalrJob, sigma: float, granularity: float, size: int) -> list[int]:
    """Exact discrete Gaussian noise in grid steps, drawn by ``release_noise``.

    The masked sum is a huge integer (grid steps plus a 256-bit mask), beyond what
    ``release_noise`` accepts, so the noise is drawn on the zero vector with the same sampler
    and grid, converted to steps (exact: a power-of-two scale of integers below 2^53) and added
    as integers.
    """
    noise = release_noise(
        np.zeros(size), sigma, granularity, noise=job.noise, testing=job.noiseless_for_tests
    )
    return [int(v) for v in np.rint(noise / granularity).astype(np.int64)]


def _comparison_sigmas(job: WalrJob, sensitivity: float) -> dict[str, float | None]:
    """Continuous-Gaussian calibrations shown beside the one used (classic: epsilon <= 1 only)."""
    try:
        classic = classic_gaussian_sigma(job.epsilon, job.delta, sensitivity)
    except PrivacyParameterError:
        classic = None
    return {
        "sigma_analytic_continuous": analytic_gaussian_sigma(job.epsilon, job.delta, sensitivity),
        "sigma_classic": classic,
    }


def _decrypt_once(job: WalrJob, ref: TableRef, message: Any) -> list[int]:
    """Decrypt the features party's masked sums: exactly ``columns + 1`` values (agreed at
    set-up), one message per job (recorded before decryption), units only. What each refusal
    stops, and what it cannot: docs/protocols/walr.md (what each party learns)."""
    sender = job.features_party
    sums = message.get("sums") if isinstance(message, dict) else None
    expected = (job.columns + 1) if job.columns is not None else None
    if not isinstance(sums, list) or expected is None or len(sums) != expected:
        got = len(sums) if isinstance(sums, list) else "no list of"
        raise ReleaseRefusalError(
            f"{ref.party} refuses the masked sums of {sender}: {got} values, the length agreed "
            f"at set-up is {expected}"
        )
    artifacts = ArtifactStore(PartyStore.of(ref))
    digest = hashlib.sha256(codec.dumps(sums)).hexdigest()
    seen = artifacts.get(job.key("decrypted"))
    if seen is not None and seen != digest:
        raise ReleaseRefusalError(
            f"{ref.party} refuses a second, different set of masked sums from {sender}: it "
            "decrypts one per job"
        )
    private = _private_key(job, ref)
    artifacts.put(job.key("decrypted"), digest, "decryption-record")
    try:
        return cipher.decrypt(private, sums)
    except (PaillierError, TypeError) as error:
        raise ReleaseRefusalError(
            f"{ref.party} refuses the masked sums of {sender}: {error}"
        ) from None


@task(name="walr-release", task_run_name="{ref.party}: decrypt, add noise, charge", **PARTY_STEP)
def release_noisy_sums(job: WalrJob, ref: TableRef) -> None:
    """Decrypt the masked sums, add calibrated noise, store the release and charge the ledger
    in one transaction. A release already stored under the key is kept as it is."""
    ledger = PrivacyLedger(PartyStore.of(ref))
    if ledger.stored_release(job.release_key) is not None:
        return
    table = _budget_table(job, ref)
    _, labels = _labels(ref)
    event = _release_event(job, labels.size)
    ledger.require_affordable(table, job.epsilon, job.delta, event=event)  # before decrypting
    message = job.endpoint(ref.party).receive(job.features_party, "walr_masked_sums")
    masked = _decrypt_once(job, ref, message)
    training = len(job.split(labels.size)[0])
    shape = public_shape(job.mode, training, len(masked) - 1, job.clip_norm)
    sigma = walr_sigma(job.epsilon, job.delta, shape)
    noise = _noise_units(job, sigma, shape.granularity, len(masked))
    release = {
        "job_id": job.job_id,
        "mask_id": message["mask_id"],
        "values": [m + e for m, e in zip(masked, noise, strict=True)],
        "rows": training,
        "held_out_rows": int(labels.size) - training,
        "columns": len(masked) - 1,
        "mode": job.mode,
        "clip_norm": job.clip_norm,
        "granularity": shape.granularity,
        "sensitivity": shape.sensitivity,
        "epsilon": job.epsilon,
        "delta": job.delta,
        "noise": job.noise,
        "sigma": sigma,
        **_comparison_sigmas(job, shape.sensitivity),
    }
    ledger.charge_and_store(
        job.release_key,
        table,
        job.epsilon,
        job.delta,
        job.mechanism,
        job.job_id,
        release,
        consumer=job.features_party,
        event=event,
    )


@task(
    name="walr-send-release", task_run_name="{ref.party}: send the noisy masked sums", **PARTY_STEP
)
def send_release(job: WalrJob, ref: TableRef) -> dict[str, Any]:
    """Send the stored release (new or reused); return its public facts and the budget left."""
    ledger = PrivacyLedger(PartyStore.of(ref))
    release = ledger.stored_release(job.release_key)
    if release is None:
        raise WalrSetupError(f"no release is stored under {job.release_key}")
    payload = {k: release[k] for k in ("job_id", "mask_id", "values")}
    job.endpoint(ref.party).send(job.features_party, "walr_release", payload)
    # decryption is over for this job: drop the key pair and shred the job's key file (p, q)
    job.key_pair(ref).retire("keypair")
    public = {k: v for k, v in release.items() if k not in ("values", "mask_id")}
    return {
        **public,
        "release_job_id": release["job_id"],
        "budget": ledger.status(ref.table).as_dict(),
    }


# ---- training and evaluation ------------------------------------------------------------------
@task(name="walr-train", task_run_name="{ref.party}: unmask and fit", **PARTY_STEP)
def train(job: WalrJob, ref: TableRef, l2: float) -> dict[str, Any]:
    """Remove the mask, fit logistic regression on the noisy sum in the clear, save the model."""
    artifacts = ArtifactStore(PartyStore.of(ref))
    release = job.endpoint(ref.party).receive(job.labels_party, "walr_release")
    masks = artifacts.get(_mask_key(release["job_id"], release["mask_id"]))
    if masks is None:
        raise WalrSetupError(
            f"the release was masked in job {release['job_id']}, whose mask is not in "
            f"{ref.party}'s store; it cannot be unmasked"
        )
    ids, features, fitted = _features(job, ref)
    width = len(features.column_names) + 1
    if not len(release["values"]) == len(masks) == width:
        raise WalrSetupError(f"the release has {len(release['values'])} sums, expected {width}")
    units = [v - r for v, r in zip(release["values"], masks, strict=True)]
    if any(abs(u) >= _EXACT_FLOAT_INT for u in units):
        raise WalrSetupError("the unmasked release is not a sum of this table's grid values")
    noisy_sum = np.array(units, dtype=np.float64) * features.granularity
    train, held_out = job.split(features.n_rows)
    fit = fit_walr(features.values[train], noisy_sum, len(train), l2, fit_intercept=True)
    model = ModelRecord.linear(
        "walr",
        job.job_id,
        list(features.column_names),
        fit.coef,
        fit.intercept,
        rows={"train": int(train.size), "held_out": int(held_out.size)},
        preprocessing=fitted.to_dict(),
        extras={
            "converged": fit.converged,
            "n_iter": fit.n_iter,
            "mode": job.mode,
            "clip_norm": job.clip_norm,
            "granularity": features.granularity,
            "l2": l2,
            "epsilon": job.epsilon,
            "delta": job.delta,
            "noisy_sum": noisy_sum,
        },
        **provenance(ref),
    )
    row_ids = np.asarray(ids, dtype=object)
    models.ModelStore(artifacts.store).save(
        model_key(job.job_id), model, row_ids[train], row_ids[held_out]
    )
    return {
        "model_key": model_key(job.job_id),
        "coefficients": dict(zip(features.column_names, fit.coef.tolist(), strict=True)),
        "intercept": fit.intercept,
        "converged": fit.converged,
        "n_iter": fit.n_iter,
        "noisy_sum": noisy_sum.tolist(),
        "granularity": features.granularity,
    }


@task(name="walr-predictions", task_run_name="{ref.party}: scores for evaluation", **PARTY_STEP)
def send_predictions(job: WalrJob, ref: TableRef) -> int:
    """The labels party receives the predicted probability of the held-out rows only (of
    every row, in-sample, when nothing is held out and evaluation was asked for)."""
    model = ArtifactStore(PartyStore.of(ref)).get(model_key(job.job_id))
    _, features, _ = _features(job, ref)
    train, held_out = job.split(features.n_rows)
    rows = held_out if held_out.size else train
    coefficients = [model["coefficients"][f] for f in model["features"]]
    fit = WalrFit(np.asarray(coefficients), model["intercept"], model["converged"], model["n_iter"])
    probabilities = fit.predict_proba(features.values[rows])
    job.endpoint(ref.party).send(job.labels_party, "predictions", probabilities)
    return int(rows.size)


@task(name="walr-evaluate", task_run_name="{ref.party}: AUC and log-loss", **PARTY_STEP)
def evaluate(job: WalrJob, ref: TableRef) -> dict[str, Any]:
    """AUC and log-loss of the received scores on the true labels, next to the class-prior
    baseline. Not differentially private and not charged; only these aggregates leave."""
    _, labels = _labels(ref)
    train, held_out = job.split(labels.size)
    rows = held_out if held_out.size else train
    predictions = np.asarray(job.endpoint(ref.party).receive(job.features_party, "predictions"))
    if predictions.shape != rows.shape:
        raise WalrSetupError(
            f"{ref.party} got {predictions.size} predictions from {job.features_party} for "
            f"{rows.size} evaluated rows"
        )
    figures = classifier_figures(labels[rows], predictions, float(np.mean(labels[train])))
    return log_figures(ref.party, figures, held_out.size, labels.size)
