"""Attacks on the key holders (vertical LR's arbiter, WALR's labels party) fail, by name.

Each test plays a dishonest party against the real task functions: it sends the key holder
something other than its honest message and checks the refusal names it and that nothing
was decrypted for it, released or charged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from phe import paillier

from core.paillier import cipher
from core.paillier.decryption import CrtDecryptor
from core.paillier.errors import PaillierError
from core.paillier.keys import generate_keypair
from core.vertical_lr.schedule import Schedule
from federation.channel import Channel, ChannelError
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy, PolicyError
from tasks import vertical_lr as vlr
from tasks import walr

KEY_BITS = 512  # tests only (allow_insecure_key_size)


@pytest.fixture(scope="module")
def keypair() -> tuple[paillier.PaillierPublicKey, paillier.PaillierPrivateKey]:
    return generate_keypair(KEY_BITS, allow_insecure_key_size=True)


def test_decryption_refuses_non_units_that_would_factor_the_key(keypair) -> None:
    public, private = keypair
    decryptor = CrtDecryptor(private.p, private.q)
    honest = cipher.encrypt(public, [7, -3])
    assert cipher.decrypt(private, honest) == [7, -3]
    for forged in (public.n, private.p * 5, private.q, 0, public.nsquare, -1):
        with pytest.raises(PaillierError, match=r"not a unit|not in"):
            decryptor.decrypt_many([honest[0], forged])


# ---- vertical LR: a host against the arbiter ---------------------------------------------------
ROWS, HOST_FEATURES = 100, 3


def _tables(workspace: Path) -> tuple[TableRef, TableRef]:
    rng = np.random.default_rng(0)
    ids = np.arange(ROWS)
    guest = pd.DataFrame({"id": ids, "y": (rng.random(ROWS) < 0.5).astype(float)})
    guest["g0"] = rng.normal(size=ROWS)
    host = pd.DataFrame(rng.normal(size=(ROWS, HOST_FEATURES)), columns=["h0", "h1", "h2"])
    host.insert(0, "id", ids)
    guest_ref = TableRef(str(workspace / "guest.duckdb"), "t", label_column="y", party="guest")
    host_ref = TableRef(str(workspace / "host.duckdb"), "t", party="mallory")
    PartyStore.of(guest_ref).import_frame(guest, guest_ref)
    PartyStore.of(host_ref).import_frame(host, host_ref)
    return guest_ref, host_ref


def _vertical(
    workspace: Path, key_bits: int = KEY_BITS
) -> tuple[vlr.VerticalJob, TableRef, TableRef]:
    """Mallory's job with the arbiter, up to the guest's residual of round 0 (at
    ``key_bits``: 512 sends gradients unpacked, 1024 packs five entries a ciphertext)."""
    guest_ref, host_ref = _tables(workspace)
    schedule = Schedule(ROWS, ROWS, 0, 0.0)  # one batch of 100 rows > 3 + LABEL_LEAK_MARGIN
    vlr.check_batches(schedule, {"mallory": HOST_FEATURES})
    job = vlr.VerticalJob(
        job_id="attack",
        channel=Channel(workspace, "attack"),
        guest="guest",
        hosts=("mallory",),
        key_holder="arbiter",
        key_holder_database=str(workspace / "arbiter.duckdb"),
        schedule=schedule,
        learning_rate=0.1,
        momentum=0.0,
        decay=0.0,
        l2=0.0,
        widths=(("guest", 2), ("mallory", HOST_FEATURES)),
        key_size=key_bits,
    )
    vlr.create_keys.fn(job, key_bits)
    vlr.host_forward.fn(job, host_ref, 0)
    vlr.guest_residual.fn(job, guest_ref, 0)
    return job, guest_ref, host_ref


def _answered(job: vlr.VerticalJob, party: str) -> bool:
    try:
        job.endpoint(party).receive("arbiter", "masked_gradient_plain", round=0)
    except ChannelError:
        return False
    return True


def _forge(job: Any, receiver: str, kind: str, payload: Any) -> None:
    """Mallory replaces a message in its own outbox: the channel's no-replace rule binds honest
    code, not an attacker who writes its folder itself."""
    channel = job.endpoint("mallory").channel
    key = channel.key(0, "mallory", receiver, kind)
    channel.transport.store().path(key).unlink(missing_ok=True)
    job.endpoint("mallory").send(receiver, kind, payload, round=0)


def _forge_gradient(job: vlr.VerticalJob, payload: list[int]) -> None:
    _forge(job, "arbiter", "masked_gradient", payload)


def test_vertical_key_holder_refuses_key_recovery_and_the_guests_residual(
    workspace: Path,
) -> None:
    job, _, _ = _vertical(workspace)
    n = paillier.PaillierPublicKey(
        ArtifactStore(PartyStore(job.key_holder_database)).get("vertical/attack/keypair")["n"]
    ).n
    # 1. ciphertexts that share a factor with n would factor the arbiter's key
    _forge_gradient(job, [n] * HOST_FEATURES)
    with pytest.raises(vlr.KeyHolderRefusalError, match=r"of mallory for round 0.*not a unit"):
        vlr.key_holder_decrypt.fn(job, 0)
    # 2. the guest's [[d]] (batch length), submitted as a "gradient", is not the agreed shape
    residual = job.endpoint("mallory").receive("guest", "residual", round=0)
    assert len(residual) == ROWS
    _forge_gradient(job, residual)
    with pytest.raises(vlr.KeyHolderRefusalError, match=r"of mallory .* 100 values.* is 3"):
        vlr.key_holder_decrypt.fn(job, 0)
    # 3. a vector of the wrong width in general, and not a list at all
    _forge_gradient(job, residual[:5])
    with pytest.raises(vlr.KeyHolderRefusalError, match=r"mallory"):
        vlr.key_holder_decrypt.fn(job, 0)
    assert not _answered(job, "mallory")


def test_vertical_key_holder_decrypts_each_partys_message_once_per_round(
    workspace: Path,
) -> None:
    job, _, host_ref = _vertical(workspace)
    vlr.host_gradient.fn(job, host_ref, 0)
    vlr.key_holder_decrypt.fn(job, 0)  # the honest round
    honest = job.endpoint("mallory").receive("arbiter", "masked_gradient_plain", round=0)
    assert len(honest) == HOST_FEATURES
    vlr.key_holder_decrypt.fn(job, 0)  # a retry re-sends the same message: answered again
    # a second, different request in the same round (three entries of the guest's [[d]])
    public = paillier.PaillierPublicKey(job.endpoint("mallory").receive("arbiter", "public_key"))
    residual = job.endpoint("mallory").receive("guest", "residual", round=0)
    _forge_gradient(job, cipher.rerandomize(public, residual[:HOST_FEATURES]))
    with pytest.raises(vlr.KeyHolderRefusalError, match=r"second, different .* from mallory"):
        vlr.key_holder_decrypt.fn(job, 0)
    assert job.endpoint("mallory").receive("arbiter", "masked_gradient_plain", round=0) == honest
    # the honest parties' round completes with the first answer
    vlr.update_weights.fn(job, host_ref, 0, "host")


def test_batches_that_leak_labels_to_a_host_are_refused_at_set_up() -> None:
    small = Schedule(200, 80, 0, 0.1)  # 180 training rows: batches of 80, 80 and 20
    with pytest.raises(vlr.VerticalSetupError, match=r"host lab has 20 features.* 84 rows.*20"):
        vlr.check_batches(small, {"lab": 20})
    with pytest.raises(vlr.VerticalSetupError, match=r"host clinic2 has 3 features"):
        vlr.check_batches(small, {"clinic2": 3})
    vlr.check_batches(Schedule(200, 90, 0, 0.1), {"lab": 20})  # 2 x 90 rows
    demo = Schedule(470, 470, 7, 0.15)  # the demo: ~470 shared rows, batch_size 512
    vlr.check_batches(demo, {"lab": 20})


# ---- WALR: the features party against the labels party ---------------------------------------
COLUMNS = 3


def _walr(workspace: Path, keypair, noise: bool = True, protected: str = "conversions"):
    public, private = keypair
    rng = np.random.default_rng(1)
    labels = pd.DataFrame({"id": np.arange(60), "y": (rng.random(60) < 0.5).astype(float)})
    ref = TableRef(str(workspace / "advertiser.duckdb"), "conversions", label_column="y",
                   party="advertiser")  # fmt: skip
    store = PartyStore.of(ref)
    store.import_frame(labels, ref)
    PrivacyLedger(store).set_budget("conversions", 2.0, 1e-4)
    job = walr.WalrJob(
        job_id="walr-attack",
        channel=Channel(workspace, "walr-attack"),
        features_party="mallory",
        labels_party="advertiser",
        epsilon=1.0,
        delta=1e-5,
        mode="clipped",
        clip_norm=2.0,
        protected_table=protected,
        labels_fingerprint="l",
        features_fingerprint="f",
        noise=noise,
        noiseless_for_tests=not noise,
        columns=COLUMNS,
    )
    ArtifactStore(store).put(job.key("keypair"), {"n": public.n}, "public-key")
    job.key_pair(ref).sealed.put(job.key("factors"), {"p": private.p, "q": private.q})
    return job, ref


def _nothing_released(ref: TableRef, job: walr.WalrJob) -> None:
    ledger = PrivacyLedger(PartyStore.of(ref))
    assert ledger.spends() == []
    assert ledger.stored_release(job.release_key) is None


def _send_sums(job: walr.WalrJob, sums: list[int]) -> None:
    _forge(job, "advertiser", "walr_masked_sums", {"mask_id": "m", "sums": sums})


def test_walr_labels_party_refuses_copies_of_n_and_a_wrong_shape(workspace: Path, keypair):
    public, _ = keypair
    job, ref = _walr(workspace, keypair)
    _send_sums(job, [public.n] * 5000)  # thousands of copies to average the noise away
    with pytest.raises(walr.ReleaseRefusalError, match=r"sums of mallory: 5000 values.* is 4"):
        walr.release_noisy_sums.fn(job, ref)
    _nothing_released(ref, job)
    _send_sums(job, [public.n] * (COLUMNS + 1))  # the agreed shape, but no ciphertexts
    with pytest.raises(walr.ReleaseRefusalError, match=r"sums of mallory: .*not a unit"):
        walr.release_noisy_sums.fn(job, ref)
    _nothing_released(ref, job)


def test_walr_decrypts_one_set_of_sums_and_charges_its_own_source_table(workspace, keypair):
    public, _ = keypair
    job, ref = _walr(workspace, keypair)
    first = cipher.encrypt(public, [2**200 + i for i in range(COLUMNS + 1)])
    _send_sums(job, first)
    walr.release_noisy_sums.fn(job, ref)  # honest shape: released and charged once
    ledger = PrivacyLedger(PartyStore.of(ref))
    once = ledger.status("conversions").epsilon_spent  # one release, composed at the owner's delta
    assert len(ledger.spends("conversions")) == 1 and 0 < once <= 1.0
    # a second, different set for a job whose release is not stored is refused
    other = dataclasses.replace(job, epsilon=0.5)
    _send_sums(other, cipher.encrypt(public, [1] * (COLUMNS + 1)))
    with pytest.raises(walr.ReleaseRefusalError, match=r"second, different .* from mallory"):
        walr.release_noisy_sums.fn(other, ref)
    assert ledger.status("conversions").epsilon_spent == once  # nothing more charged
    # a caller cannot point the charge at another table's budget
    elsewhere = dataclasses.replace(job, protected_table="other_table", epsilon=0.25)
    with pytest.raises(walr.ReleaseRefusalError, match=r"advertiser charges .* 'conversions'"):
        walr.check_labels_and_budget.fn(elsewhere, ref)


def test_walr_noiseless_release_needs_the_owners_policy(workspace: Path, keypair) -> None:
    public, _ = keypair
    job, ref = _walr(workspace, keypair, noise=False)
    _send_sums(job, cipher.encrypt(public, [5] * (COLUMNS + 1)))
    for step in (walr.check_labels_and_budget, walr.release_noisy_sums):
        with pytest.raises(PolicyError, match=r"advertiser refuses .* table 'conversions'"):
            step.fn(job, ref)
    _nothing_released(ref, job)
    OwnerPolicy(PartyStore.of(ref)).set("conversions", allow_noiseless_release=True)
    walr.release_noisy_sums.fn(job, ref)
    release = PrivacyLedger(PartyStore.of(ref)).stored_release(job.release_key)
    assert release["values"] == [5] * (COLUMNS + 1)  # exact, as the owner allowed


@pytest.mark.usefixtures("prefect_server")
def test_the_arbiter_deletes_its_private_key_when_the_job_ends(workspace: Path) -> None:
    from flows.vertical_lr import vertical_lr

    guest_ref, host_ref = _tables(workspace)
    options = {
        "batch_size": ROWS,
        "holdout_fraction": 0.0,
        "key_size": KEY_BITS,
        "workspace": str(workspace),
        "arbiter_database": str(workspace / "arb.duckdb"),
    }
    result = vertical_lr(guest_ref.to_dict(), [host_ref.to_dict()], epochs=1, **options)
    assert set(result) >= {"party", "coefficients", "intercept", "metrics", "scores_table"}
    assert result["party"] == "guest" and list(result["coefficients"]) == ["g0"]
    arbiter = ArtifactStore(PartyStore(workspace / "arb.duckdb"))
    stored = arbiter.get(f"vertical/{result['job_id']}/keypair")
    assert set(stored) == {"n"}  # p and q are gone
    again = vertical_lr(guest_ref.to_dict(), [host_ref.to_dict()], epochs=1, **options)
    assert again["rounds_run"] == 0 and again["coefficients"] == result["coefficients"]
    with pytest.raises(vlr.KeyHolderRefusalError, match="deleted the private key"):
        vertical_lr(guest_ref.to_dict(), [host_ref.to_dict()], epochs=2, **options)
