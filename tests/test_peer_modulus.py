"""Encrypting parties check the key holder's modulus before encrypting anything under it.

The guest and a host of vertical LR, and WALR's features party, receive ``n`` from the key
holder over the channel; each must refuse a modulus that is too small for what it opted into,
of another size than the job states, even, a perfect power or with a small prime factor,
naming the key holder, and send nothing.
"""

from __future__ import annotations

import secrets

import gmpy2
import numpy as np
import pandas as pd
import pytest
from prefect.logging import disable_run_logger

from core.paillier.errors import PeerKeyError
from core.paillier.keys import SMALL_KEYS_VARIABLE, check_peer_modulus, generate_keypair
from core.vertical_lr.schedule import Schedule
from federation.channel import Channel
from federation.workspace import channel_for
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import vertical_lr as vlr
from tasks import walr

ROWS = 80
SMALL_PRIME = 1048573  # the largest prime below 2^20


def odd_with_bits(bits: int) -> int:
    return secrets.randbits(bits) | (1 << (bits - 1)) | 1


def small_factor_modulus(bits: int) -> int:
    """``SMALL_PRIME`` times an odd cofactor: ``bits`` bits, odd, not a perfect power."""
    while True:
        n = SMALL_PRIME * odd_with_bits(bits - 20)
        if n.bit_length() == bits:
            return n


@pytest.fixture(scope="module")
def modulus_1024() -> int:
    return generate_keypair(1024, allow_insecure_key_size=True)[0].n


@pytest.fixture(scope="module")
def bad_moduli(modulus_1024: int) -> dict[str, tuple[int, bool, str]]:
    """(n, whether this party opted into small keys, the refusal) for a 1024-bit job."""
    return {
        "1024-bit": (modulus_1024, False, "below 2048 bits"),
        "even": (odd_with_bits(1024) ^ 1, True, "even"),
        "small factor": (small_factor_modulus(1024), True, "prime factor below 2\\^20"),
    }


def test_the_check_accepts_a_real_key_and_refuses_each_flaw(modulus_1024: int) -> None:
    def check(n: int, bits: int = 1024, allow: bool = True) -> int:
        return check_peer_modulus(
            n, expected_bits=bits, allow_insecure_key_size=allow, holder="arbiter"
        )

    assert check(modulus_1024) == modulus_1024
    p = gmpy2.next_prime(odd_with_bits(512))
    refusals = {
        "below 2048 bits": lambda: check(modulus_1024, allow=False),
        "terms state a 2048-bit key": lambda: check(modulus_1024, bits=2048),
        "even": lambda: check(odd_with_bits(1024) ^ 1),
        "perfect power": lambda: check(int(p * p), bits=int(p * p).bit_length()),
        "prime factor below": lambda: check(small_factor_modulus(1024)),
        "not a modulus": lambda: check("1234"),  # type: ignore[arg-type]
    }
    for reason, attempt in refusals.items():
        with pytest.raises(PeerKeyError, match=f"{reason}") as refused:
            attempt()
        assert "arbiter" in str(refused.value)


def vertical_job(workspace, key_bits: int) -> tuple[vlr.VerticalJob, TableRef, TableRef]:
    rng = np.random.default_rng(2)
    ids = [f"r{i}" for i in range(ROWS)]
    guest = TableRef(str(workspace / "clinic.duckdb"), "t", label_column="y")
    host = TableRef(str(workspace / "lab.duckdb"), "t")
    frame = pd.DataFrame({"id": ids, "y": (rng.random(ROWS) < 0.5).astype(float), "g": 1.0})
    PartyStore.of(guest).import_frame(frame, guest)
    PartyStore.of(host).import_frame(pd.DataFrame({"id": ids, "h": rng.normal(size=ROWS)}), host)
    job_id = f"modulus-{secrets.token_hex(4)}"
    job = vlr.VerticalJob(
        job_id=job_id, channel=Channel(workspace, job_id), guest="clinic",
        hosts=("lab",), key_holder="arbiter", key_holder_database=str(workspace / "arb.duckdb"),
        schedule=Schedule(ROWS, ROWS, 0, 0.0), learning_rate=0.1, momentum=0.0, decay=0.0,
        l2=0.0, widths=(("clinic", 2), ("lab", 1)), key_size=key_bits,
    )  # fmt: skip
    return job, guest, host


@pytest.mark.parametrize("flaw", ["1024-bit", "even", "small factor"])
def test_guest_and_host_refuse_a_bad_modulus_before_encrypting(
    workspace, bad_moduli, flaw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each party decides from its own process's opt-in: without it a 1024-bit key is refused."""
    n, allow, reason = bad_moduli[flaw]
    if not allow:
        monkeypatch.delenv(SMALL_KEYS_VARIABLE)
    job, guest, host = vertical_job(workspace, 1024)
    for party in ("clinic", "lab"):  # the key holder hands out its n
        job.endpoint("arbiter").send(party, "public_key", n)
    with disable_run_logger():
        with pytest.raises(PeerKeyError, match=f"key holder arbiter: .*{reason}"):
            vlr.host_forward.fn(job, host, 0)
        with pytest.raises(PeerKeyError, match=f"key holder arbiter: .*{reason}"):
            vlr.guest_residual.fn(job, guest, 0)
    sent = {record.sender for record in channel_for(job.job_id, str(workspace)).log()}
    assert sent == {"arbiter"}  # neither encrypted nor sent anything
    for ref in (guest, host):  # nor kept the modulus as the job's key
        assert ArtifactStore(PartyStore.of(ref)).get(f"vertical/{job.job_id}/public_key") is None


def test_a_sound_modulus_of_the_stated_size_is_used(workspace, modulus_1024: int) -> None:
    job, _, host = vertical_job(workspace, 1024)
    job.endpoint("arbiter").send("lab", "public_key", modulus_1024)
    with disable_run_logger():
        vlr.host_forward.fn(job, host, 0)
    sent = {(r.sender, r.kind) for r in channel_for(job.job_id, str(workspace)).log()}
    assert ("lab", "share_train") in sent


def test_walr_features_party_refuses_a_small_factor_modulus(workspace) -> None:
    rng = np.random.default_rng(3)
    features = TableRef(str(workspace / "pub.duckdb"), "impressions")
    frame = pd.DataFrame({"id": [f"u{i}" for i in range(ROWS)], "a": rng.normal(size=ROWS)})
    PartyStore.of(features).import_frame(frame, features)
    job = walr.WalrJob(
        job_id="walr-modulus", channel=Channel(workspace, "walr-modulus"), features_party="pub",
        labels_party="shop", epsilon=1.0, delta=1e-5, mode="clipped", clip_norm=2.0,
        protected_table="conversions", labels_fingerprint="l", features_fingerprint="f",
        columns=1, key_size=1024,
    )  # fmt: skip
    endpoint = job.endpoint("shop")
    endpoint.send("pub", "walr_public_key", small_factor_modulus(1024))
    endpoint.send("pub", "walr_encrypted_labels", [3] * ROWS)
    with (
        disable_run_logger(),
        pytest.raises(PeerKeyError, match=r"key holder shop: .*prime factor below"),
    ):
        walr.masked_sums.fn(job, features)
    assert {r.sender for r in channel_for(job.job_id, str(workspace)).log()} == {"shop"}
    assert ArtifactStore(PartyStore.of(features)).list("walr/walr-modulus/mask/") == []
