"""Secure aggregation: exact sums, dropout recovery, refusal of unsafe requests, uniform masks."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from scipy import stats

from core.secagg import (
    DROPOUT_STAGES,
    ConfigError,
    FixedPointError,
    InsufficientSurvivorsError,
    ProtocolViolationError,
    advertise_keys,
    collect_key_advertisements,
    collect_masked_inputs,
    decode,
    encode,
    mask_input,
    mask_ring_input,
    max_abs_value,
    new_session,
    reconstruct_sum,
    reveal_shares,
    route_encrypted_shares,
    secure_ring_sum,
    secure_sum,
    secure_weighted_mean,
    shamir,
    share_keys,
    start_coordinator,
)
from core.secagg.fixed_point import DEFAULT_SCALE_BITS

RNG = np.random.default_rng(20240611)
HALF_STEP = 2.0 ** -(DEFAULT_SCALE_BITS + 1)
PLAIN_TYPES = (bytes, int, str, float, type(None), np.ndarray)


def random_ring_vectors(n: int, dimension: int) -> list[np.ndarray]:
    return [RNG.integers(0, 2**64, size=dimension, dtype=np.uint64) for _ in range(n)]


def ring_total(vectors: list[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(vectors[0])
    for vector in vectors:
        total += vector  # uint64 arithmetic wraps: this is the sum in Z_2^64
    return total


def assert_plain(value: object, path: str = "message") -> None:
    """Recursively check that a value only contains transport-friendly plain types."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{path} has non-string key {key!r}"
            assert_plain(item, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            assert_plain(item, f"{path}[{index}]")
    else:
        assert isinstance(value, PLAIN_TYPES), f"{path} is a {type(value).__name__}"


class Round:
    """Runs the explicit steps by hand, so tests can intercept or forge messages."""

    def __init__(self, n: int, threshold: int, dimension: int, session: str = "test") -> None:
        self.names = [f"p{i}" for i in range(n)]
        self.config = new_session(session, self.names, threshold, dimension)
        self.coordinator = start_coordinator(self.config)
        self.states = {}
        advertisements = []
        for name in self.names:
            self.states[name], advertisement = advertise_keys(self.config, name)
            advertisements.append(advertisement)
        self.coordinator, self.directory = collect_key_advertisements(
            self.coordinator, advertisements
        )
        shares = []
        for name in self.names:
            self.states[name], message = share_keys(self.states[name], self.directory)
            shares.append(message)
        self.coordinator, self.deliveries = route_encrypted_shares(self.coordinator, shares)

    def mask(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        messages = []
        for name, values in inputs.items():
            self.states[name], message = mask_input(
                self.states[name], self.deliveries[name], values
            )
            messages.append(message)
        self.coordinator, self.request = collect_masked_inputs(self.coordinator, messages)
        return {m["party"]: m["masked_input"] for m in messages}


# --- fixed point ---------------------------------------------------------------------------


def test_fixed_point_round_trip_error_is_at_most_half_a_step() -> None:
    values = RNG.normal(scale=100.0, size=10_000)
    decoded = decode(encode(values, n_parties=10))
    assert np.max(np.abs(decoded - values)) <= HALF_STEP


def test_fixed_point_sum_of_signed_values_decodes_to_the_float_sum() -> None:
    vectors = [RNG.normal(scale=50.0, size=1_000) for _ in range(6)]
    encoded = ring_total([encode(v, n_parties=6) for v in vectors])
    assert np.max(np.abs(decode(encoded) - np.sum(vectors, axis=0))) <= 6 * HALF_STEP


def test_fixed_point_bound_keeps_n_party_sums_from_wrapping() -> None:
    n = 7
    limit = max_abs_value(n)
    at_limit = encode(np.array([limit, -limit]), n_parties=n)
    total = ring_total([at_limit] * n)
    assert np.allclose(decode(total), [n * limit, -n * limit], rtol=1e-12)
    over = np.zeros(5)
    over[3] = limit * 1.001
    with pytest.raises(FixedPointError, match="element 3"):
        encode(over, n_parties=n, party="party 'bank'")


def test_fixed_point_refuses_non_finite_values_naming_the_element() -> None:
    with pytest.raises(FixedPointError, match=r"'hospital'.*element 2"):
        encode(np.array([0.0, 1.0, np.nan]), n_parties=3, party="party 'hospital'")


# --- exact sums and dropouts ---------------------------------------------------------------


def test_ring_sum_equals_plain_sum_exactly() -> None:
    vectors = random_ring_vectors(5, 257)
    result = secure_ring_sum(vectors, threshold=3)
    assert result.contributors == (0, 1, 2, 3, 4)
    assert np.array_equal(result.ring_sum, ring_total(vectors))


def test_float_sum_is_within_fixed_point_error() -> None:
    vectors = [RNG.normal(scale=10.0, size=500) for _ in range(4)]
    result = secure_sum(vectors, threshold=3)
    assert np.max(np.abs(result.total - np.sum(vectors, axis=0))) <= 4 * HALF_STEP


@pytest.mark.parametrize("stage", DROPOUT_STAGES)
def test_sum_is_exact_with_n_minus_t_dropouts_at_one_stage(stage: str) -> None:
    n, threshold, dropped = 7, 4, {1, 4, 6}
    vectors = random_ring_vectors(n, 64)
    result = secure_ring_sum(vectors, threshold, dropouts={stage: dropped})
    # a party silent only at unmasking did send its masked input, so it is still in the sum
    expected = set(range(n)) if stage == "reveal_shares" else set(range(n)) - dropped
    assert set(result.contributors) == expected
    assert np.array_equal(result.ring_sum, ring_total([vectors[i] for i in sorted(expected)]))


def test_sum_is_exact_with_dropouts_spread_over_stages() -> None:
    vectors = random_ring_vectors(9, 33)
    dropouts = {"advertise_keys": [0], "share_keys": [3], "mask_input": [5], "reveal_shares": [8]}
    result = secure_ring_sum(vectors, threshold=5, dropouts=dropouts)
    assert result.contributors == (1, 2, 4, 6, 7, 8)
    assert np.array_equal(result.ring_sum, ring_total([vectors[i] for i in result.contributors]))


@pytest.mark.parametrize("stage", DROPOUT_STAGES)
def test_fewer_than_threshold_survivors_aborts(stage: str) -> None:
    vectors = random_ring_vectors(5, 8)
    with pytest.raises(InsufficientSurvivorsError, match="threshold 3"):
        secure_ring_sum(vectors, threshold=3, dropouts={stage: [0, 2, 4]})


def test_cumulative_dropouts_below_threshold_abort() -> None:
    vectors = random_ring_vectors(5, 8)
    dropouts = {"advertise_keys": [0], "share_keys": [1], "mask_input": [2]}
    with pytest.raises(InsufficientSurvivorsError, match="masked input"):
        secure_ring_sum(vectors, threshold=3, dropouts=dropouts)


def test_weighted_mean_and_loss_match_numpy_average_over_contributors() -> None:
    updates = [RNG.normal(size=20) for _ in range(5)]
    rows = [120.0, 80.0, 300.0, 45.0, 999.0]
    losses = [0.7, 0.4, 0.55, 0.9, 0.3]
    result = secure_weighted_mean(updates, rows, losses, threshold=3, dropouts={"mask_input": [2]})
    kept = list(result.contributors)
    assert kept == [0, 1, 3, 4]
    weights = np.array(rows)[kept]
    aggregate = result.aggregate
    assert aggregate.total_weight == pytest.approx(weights.sum(), abs=1e-6)
    expected = np.average(np.array(updates)[kept], axis=0, weights=weights)
    assert np.max(np.abs(aggregate.mean - expected)) < 1e-9
    assert aggregate.mean_loss == pytest.approx(np.average(np.array(losses)[kept], weights=weights))


# --- what the coordinator sees --------------------------------------------------------------


def test_masked_inputs_look_uniform_and_differ_from_the_input() -> None:
    dimension = 20_000
    protocol = Round(n=3, threshold=2, dimension=dimension)
    inputs = {name: RNG.normal(scale=0.1, size=dimension) for name in protocol.names}
    masked = protocol.mask(inputs)
    for name, vector in masked.items():
        encoded = encode(inputs[name], n_parties=3)
        for candidate, should_look_uniform in ((vector, True), (encoded, False)):
            ks = stats.kstest(candidate.astype(np.float64) / 2.0**64, "uniform").pvalue
            byte_counts = np.bincount(candidate.view(np.uint8), minlength=256)
            chi2 = stats.chisquare(byte_counts).pvalue
            # at 1e-6 a truly uniform vector fails with negligible probability
            assert bool(min(ks, chi2) > 1e-6) is should_look_uniform, (name, ks, chi2)
        assert np.mean(vector == encoded) < 1e-3


# --- refusing to unmask a party that sent ---------------------------------------------------


def test_party_refuses_request_listing_someone_as_both_sender_and_dropped() -> None:
    protocol = Round(n=5, threshold=3, dimension=4)
    protocol.mask({name: np.ones(4) for name in protocol.names})
    forged = dict(protocol.request, dropped=["p3"])  # p3 is also in input_senders
    for name in protocol.names:
        with pytest.raises(ProtocolViolationError, match=r"both"):
            reveal_shares(protocol.states[name], forged)


def test_party_refuses_request_claiming_it_dropped() -> None:
    protocol = Round(n=5, threshold=3, dimension=4)
    protocol.mask({name: np.ones(4) for name in protocol.names})
    forged = dict(protocol.request, input_senders=["p0", "p1", "p2", "p4"], dropped=["p3"])
    with pytest.raises(ProtocolViolationError, match="dropped"):
        reveal_shares(protocol.states["p3"], forged)


def test_coordinator_cannot_collect_both_secrets_of_a_sender_by_asking_twice() -> None:
    protocol = Round(n=5, threshold=3, dimension=4)
    protocol.mask({name: np.ones(4) for name in protocol.names})
    honest = protocol.request
    lie = dict(honest, input_senders=["p0", "p1", "p2", "p3"], dropped=["p4"])
    key_shares = {}
    for name in ("p0", "p1", "p2"):  # a majority is told p4 dropped and reveals its key shares
        protocol.states[name], response = reveal_shares(protocol.states[name], lie)
        key_shares[int(name[1:]) + 1] = response["mask_key_shares"]["p4"]
        again = reveal_shares(protocol.states[name], lie)[1]  # identical retry: same answer
        assert again == response
        with pytest.raises(ProtocolViolationError, match="already answered"):
            reveal_shares(protocol.states[name], honest)
    seed_shares = {}
    for name in ("p3", "p4"):  # only a minority is left to reveal p4's self-mask seed
        protocol.states[name], response = reveal_shares(protocol.states[name], honest)
        seed_shares[int(name[1:]) + 1] = response["self_mask_seed_shares"]["p4"]
    assert shamir.reconstruct_secret(key_shares, 3) == protocol.states["p4"]["mask_private_key"]
    with pytest.raises(ValueError, match="need 3 shares"):
        shamir.reconstruct_secret(seed_shares, 3)


def test_coordinator_refuses_a_response_with_both_kinds_of_shares() -> None:
    protocol = Round(n=5, threshold=3, dimension=4)
    protocol.mask({name: np.ones(4) for name in protocol.names if name != "p4"})
    responses = []
    for name in ("p0", "p1", "p2", "p3"):
        protocol.states[name], response = reveal_shares(protocol.states[name], protocol.request)
        responses.append(response)
    held = protocol.states["p0"]["held_shares"]["p1"]["mask_key"]
    responses[0] = dict(responses[0], mask_key_shares={"p4": 1, "p1": held})
    with pytest.raises(ProtocolViolationError, match="both kinds"):
        reconstruct_sum(protocol.coordinator, responses)


def test_tampered_share_ciphertext_is_detected_naming_the_sender() -> None:
    protocol = Round(n=3, threshold=2, dimension=4)
    delivery = protocol.deliveries["p0"]
    ciphertext = bytearray(delivery["encrypted_shares"]["p2"])
    ciphertext[-1] ^= 1
    tampered = dict(
        delivery, encrypted_shares={**delivery["encrypted_shares"], "p2": bytes(ciphertext)}
    )
    with pytest.raises(ProtocolViolationError, match="from party 'p2'"):
        mask_input(protocol.states["p0"], tampered, np.zeros(4))


def test_wrong_share_from_a_responder_is_detected() -> None:
    protocol = Round(n=3, threshold=2, dimension=4)
    protocol.mask({name: np.ones(4) for name in protocol.names})
    responses = []
    for name in protocol.names:
        protocol.states[name], response = reveal_shares(protocol.states[name], protocol.request)
        responses.append(response)
    shares = dict(responses[0]["self_mask_seed_shares"])
    shares["p1"] = (shares["p1"] + 1) % shamir.PRIME
    responses[0] = dict(responses[0], self_mask_seed_shares=shares)
    with pytest.raises(ProtocolViolationError, match="p1"):
        reconstruct_sum(protocol.coordinator, responses)


def test_steps_refuse_wrong_stage_and_other_sessions() -> None:
    protocol = Round(n=3, threshold=2, dimension=4, session="round-7")
    with pytest.raises(ProtocolViolationError, match="stage"):
        share_keys(protocol.states["p0"], protocol.directory)
    other = dict(protocol.deliveries["p0"], session_id="round-6")
    with pytest.raises(ProtocolViolationError, match="round-6"):
        mask_input(protocol.states["p0"], other, np.zeros(4))


@pytest.mark.parametrize(
    ("parties", "threshold", "message"),
    [
        (["a", "b", "c", "d"], 2, "more than half"),
        (["a", "b", "c"], 4, "threshold"),
        (["a", "b", "a"], 2, "repeated"),
    ],
)
def test_unsafe_or_broken_configurations_are_refused(
    parties: list[str], threshold: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        new_session("s", parties, threshold, dimension=3)


# --- plain data, checkpointing --------------------------------------------------------------


def test_messages_and_states_are_plain_data_and_survive_checkpointing() -> None:
    """Every message and state is plain; pickling the states between steps changes nothing."""
    names = ["bank", "insurer", "telco"]
    config = new_session("ckpt", names, threshold=2, dimension=16)
    vectors = dict(zip(names, random_ring_vectors(3, 16), strict=True))
    checkpoint = pickle.dumps

    coordinator = start_coordinator(config)
    states, advertisements = {}, []
    for name in names:
        state, message = advertise_keys(config, name)
        states[name] = checkpoint(state)
        advertisements.append(message)
    coordinator, directory = collect_key_advertisements(coordinator, advertisements)
    share_messages = []
    for name in names:
        state, message = share_keys(pickle.loads(states[name]), directory)
        states[name] = checkpoint(state)
        share_messages.append(message)
    coordinator, deliveries = route_encrypted_shares(
        pickle.loads(checkpoint(coordinator)), share_messages
    )
    masked = []
    for name in ("bank", "telco"):
        state, message = mask_ring_input(
            pickle.loads(states[name]), deliveries[name], vectors[name]
        )
        states[name] = checkpoint(state)
        masked.append(message)
    coordinator, request = collect_masked_inputs(coordinator, masked)
    responses = []
    for name in ("bank", "telco"):
        state, message = reveal_shares(pickle.loads(states[name]), request)
        responses.append(message)
        assert_plain(state, f"state of {name}")
    coordinator, result = reconstruct_sum(coordinator, responses)

    for message in [
        *advertisements,
        directory,
        *share_messages,
        *deliveries.values(),
        *masked,
        request,
        *responses,
        result,
    ]:
        assert_plain(message)
    assert_plain(coordinator, "coordinator state")
    assert result["input_senders"] == ["bank", "telco"]
    assert np.array_equal(result["ring_sum"], vectors["bank"] + vectors["telco"])
