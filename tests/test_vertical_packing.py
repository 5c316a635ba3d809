"""Masked gradients packed several to a plaintext: the margin holds, the model is unchanged."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_security_keyholder import HOST_FEATURES, _forge_gradient, _vertical
from test_vertical_flow import OPTIONS, breast

from core.outcomes import DivergenceError
from core.paillier import cipher
from core.paillier.keys import generate_keypair
from core.vertical_lr.fixed_point import FixedPointRangeError, encode_residual
from core.vertical_lr.packing import STATISTICAL_BITS, Layout, PackingOverflowError, layout
from core.vertical_lr.schedule import Schedule
from federation.workspace import channel_for
from flows.vertical_lr import vertical_lr
from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore
from tasks import vertical_lr as vlr


@pytest.fixture(scope="module")
def keypair():
    return generate_keypair(1024, allow_insecure_key_size=True)


def test_slot_count_is_what_the_bound_allows() -> None:
    # |g| <= rows * 2^50 (features) * (hosts + 1) * 2^40 (residual terms)
    bound_bits = (4096 * 2**50 * 2 * 2**40).bit_length()
    assert bound_bits == 104
    slot = bound_bits + STATISTICAL_BITS + 2
    assert layout(2048, 4096, 1) == Layout(104, slot, (2048 - 2) // slot) == Layout(104, 186, 11)
    assert layout(1024, 4096, 1) == Layout(104, 186, 5)
    assert layout(1024, 90, 2).gradient_bits == (90 * 2**50 * 3 * 2**40).bit_length()
    assert layout(512, 4096, 1) is None  # two slots only: kept unpacked
    assert Layout(104, 186, 11).packed_length(300) == 28


def test_extremes_of_the_margin_round_trip_exactly(keypair) -> None:
    public, private = keypair
    shape = layout(1024, 4096, 1)
    top = 2**shape.gradient_bits - 1
    gradient = [top, -top, 0, 1, -1, 12345, top]
    masks = [2 ** (shape.gradient_bits + STATISTICAL_BITS + 1) - 1, 0] * 3 + [0]
    packed = cipher.pack(public, cipher.encrypt(public, gradient), shape.slot_bits, shape.slots)
    assert len(packed) == 2
    masked = cipher.decrypt(private, cipher.add_plain(public, packed, shape.packed_masks(masks)))
    assert all(0 < value < public.n // 2 for value in masked)
    assert shape.unpack(masked, masks) == gradient


def test_a_gradient_beyond_the_margin_raises(keypair) -> None:
    public, private = keypair
    shape = layout(1024, 4096, 1)
    for beyond in (2**shape.gradient_bits, -(2**shape.gradient_bits) - 5):
        masks = shape.masks(3)
        cts = cipher.encrypt(public, [1, beyond, 2])
        packed = cipher.pack(public, cts, shape.slot_bits, shape.slots)
        masked = cipher.decrypt(
            private, cipher.add_plain(public, packed, shape.packed_masks(masks))
        )
        with pytest.raises(PackingOverflowError):
            shape.unpack(masked, masks)
    # and the inputs that could make such a gradient are refused where they are encoded
    with pytest.raises(FixedPointRangeError, match="residual term is 70000"):
        encode_residual(np.array([0.5, 70000.0]))
    with pytest.raises(FixedPointRangeError):
        encode_residual(np.array([np.nan]))
    assert encode_residual(np.array([-(2.0**16)])) == [-(2**40)]
    # ... and in a round, such a residual ends the run as a divergence naming the round
    job = SimpleNamespace(job_id="far-out")
    diverged = r"far-out diverged in round 3: a residual term is 70000"
    with pytest.raises(DivergenceError, match=diverged), vlr._in_range(job, 3):
        encode_residual(np.array([70000.0]))


def _run(workspace: Path, packed: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setattr(vlr, "PACK_GRADIENTS", packed)
    guest_ref, host_refs, *_ = breast(workspace)
    result = vertical_lr(
        guest_ref.to_dict(), [h.to_dict() for h in host_refs], workspace=str(workspace), **OPTIONS
    )
    host = ArtifactStore(PartyStore.of(host_refs[0])).get(
        f"models/vertical/{result['job_id']}/{host_refs[0].party}"
    )
    channel = channel_for(result["job_id"], str(workspace))
    lengths = {
        (r.sender, r.round): len(channel.endpoint(r.receiver).receive(r.sender, r.kind, r.round))
        for r in channel.log()
        if r.kind == "masked_gradient"
    }
    return {"result": result, "host": host["coefficients"], "lengths": lengths}


@pytest.mark.usefixtures("prefect_server")
def test_packed_training_is_bit_for_bit_the_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _run(tmp_path / "plain", False, monkeypatch)
    packed = _run(tmp_path / "packed", True, monkeypatch)
    for key in ("intercept", "coefficients", "losses"):
        assert packed["result"][key] == plain["result"][key]  # exact, not approximately
    assert packed["host"] == plain["host"]
    # 1024 bits, batches of 90, one host: 5 slots a plaintext
    guest_width = len(plain["result"]["coefficients"]) + 1
    host_width = len(plain["host"])
    for (sender, _), length in plain["lengths"].items():
        assert length == (guest_width if sender == "guest" else host_width)
    for (sender, _), length in packed["lengths"].items():
        assert length == -(-(guest_width if sender == "guest" else host_width) // 5)
    assert len(packed["lengths"]) == len(plain["lengths"]) == 2 * OPTIONS["epochs"] * 2


def test_the_key_holder_decrypts_a_packed_gradient_once_and_only_at_its_length(
    workspace: Path,
) -> None:
    job, _, host_ref = _vertical(workspace, key_bits=1024)
    vlr.host_gradient.fn(job, host_ref, 0)
    mallory = job.endpoint("mallory")
    sent = mallory.sent("arbiter", "masked_gradient", round=0)
    assert len(sent) == 1  # three features, five slots: one ciphertext
    residual = mallory.receive("guest", "residual", round=0)
    _forge_gradient(job, residual[:HOST_FEATURES])  # the unpacked length is not agreed
    with pytest.raises(vlr.KeyHolderRefusalError, match=r"mallory .* 3 values.* is 1"):
        vlr.key_holder_decrypt.fn(job, 0)
    _forge_gradient(job, sent)
    vlr.key_holder_decrypt.fn(job, 0)  # the honest, packed round
    honest = mallory.receive("arbiter", "masked_gradient_plain", round=0)
    assert len(honest) == 1
    _forge_gradient(job, residual[:1])  # a second, different message of the packed length
    with pytest.raises(vlr.KeyHolderRefusalError, match=r"second, different .* from mallory"):
        vlr.key_holder_decrypt.fn(job, 0)
    vlr.update_weights.fn(job, host_ref, 0, "host")  # the first answer unpacks


def test_the_schedule_derives_its_rows_once_and_shares_them_read_only() -> None:
    """Every step asks for its batch; the rows are derived once per (rows, seed, fraction)
    and handed out read-only, so no step can change another's."""
    schedule = Schedule(10_000, 4096, 7, 0.1)
    again = Schedule(10_000, 4096, 7, 0.1)
    assert schedule.train_rows is again.train_rows
    with pytest.raises(ValueError, match="read-only"):
        schedule.train_rows[0] = 1
    batches = [schedule.batch(1, i) for i in range(schedule.batches_per_epoch)]
    assert np.array_equal(np.sort(np.concatenate(batches)), schedule.train_rows)
    assert not np.array_equal(batches[0], Schedule(10_000, 4096, 8, 0.1).batch(1, 0))
