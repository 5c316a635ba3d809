"""In-process driver running every party and the coordinator through the real protocol steps.

Why: tests, benchmarks and other modules (e.g. averaging sparse LDA estimates) need a secure
sum without a message bus. It calls exactly the functions a distributed deployment wires
into tasks, so it exercises the same code, including dropout recovery.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from core.secagg.coordinator import (
    collect_key_advertisements,
    collect_masked_inputs,
    reconstruct_sum,
    route_encrypted_shares,
    start_coordinator,
)
from core.secagg.errors import ConfigError
from core.secagg.fixed_point import DEFAULT_SCALE_BITS, decode, encode
from core.secagg.party import PartyState, advertise_keys, mask_ring_input, reveal_shares, share_keys
from core.secagg.session import default_threshold, new_session
from core.secagg.weighted import WeightedAggregate, pack_weighted, unpack_weighted

#: Stages at which a party can go silent; it sends nothing from that stage on.
DROPOUT_STAGES = ("advertise_keys", "share_keys", "mask_input", "reveal_shares")


@dataclass(frozen=True)
class RingSumResult:
    """Exact sum in Z_2^64 of the vectors of the parties that sent a masked input."""

    ring_sum: np.ndarray
    contributors: tuple[int, ...]


@dataclass(frozen=True)
class SecureSumResult:
    """Decoded float sum of the contributors' vectors (fixed-point error only)."""

    total: np.ndarray
    contributors: tuple[int, ...]


@dataclass(frozen=True)
class SecureWeightedMean:
    """Weighted means over the contributors, as revealed by one secure sum."""

    aggregate: WeightedAggregate
    contributors: tuple[int, ...]


def secure_ring_sum(
    ring_vectors: Sequence[np.ndarray],
    threshold: int | None = None,
    dropouts: Mapping[str, Collection[int]] | None = None,
    session_id: str | None = None,
) -> RingSumResult:
    """Sum uint64 vectors mod 2^64 with the full protocol.

    ``dropouts`` maps a stage in :data:`DROPOUT_STAGES` to the indices of parties that fall
    silent at that stage. ``threshold`` defaults to a strict majority.
    """
    vectors = _check_vectors(ring_vectors)
    n = len(vectors)
    names = [f"party-{i}" for i in range(n)]
    config = new_session(
        session_id or secrets.token_hex(16),
        names,
        default_threshold(n) if threshold is None else threshold,
        dimension=vectors[0].size,
    )
    silent = _dropout_schedule(dropouts, n)
    active = [i for i in range(n) if i not in silent["advertise_keys"]]

    coordinator = start_coordinator(config)
    states: dict[int, PartyState] = {}
    advertisements = []
    for i in active:
        states[i], advertisement = advertise_keys(config, names[i])
        advertisements.append(advertisement)
    coordinator, directory = collect_key_advertisements(coordinator, advertisements)

    active = [i for i in active if i not in silent["share_keys"]]
    share_messages = []
    for i in active:
        states[i], message = share_keys(states[i], directory)
        share_messages.append(message)
    coordinator, deliveries = route_encrypted_shares(coordinator, share_messages)

    active = [i for i in active if i not in silent["mask_input"]]
    masked_messages = []
    for i in active:
        states[i], message = mask_ring_input(states[i], deliveries[names[i]], vectors[i])
        masked_messages.append(message)
    coordinator, request = collect_masked_inputs(coordinator, masked_messages)

    active = [i for i in active if i not in silent["reveal_shares"]]
    responses = []
    for i in active:
        states[i], response = reveal_shares(states[i], request)
        responses.append(response)
    coordinator, aggregate = reconstruct_sum(coordinator, responses)
    contributors = tuple(names.index(p) for p in aggregate["input_senders"])
    return RingSumResult(ring_sum=aggregate["ring_sum"], contributors=contributors)


def secure_sum(
    vectors: Sequence[np.ndarray],
    threshold: int | None = None,
    dropouts: Mapping[str, Collection[int]] | None = None,
    scale_bits: int = DEFAULT_SCALE_BITS,
    session_id: str | None = None,
) -> SecureSumResult:
    """Sum float vectors: fixed-point encode per party, secure ring sum, decode."""
    encoded = [
        encode(v, len(vectors), scale_bits, party=f"party-{i}") for i, v in enumerate(vectors)
    ]
    result = secure_ring_sum(encoded, threshold, dropouts, session_id)
    return SecureSumResult(
        total=decode(result.ring_sum, scale_bits), contributors=result.contributors
    )


def secure_weighted_mean(
    updates: Sequence[np.ndarray],
    weights: Sequence[float],
    losses: Sequence[float] | None = None,
    threshold: int | None = None,
    dropouts: Mapping[str, Collection[int]] | None = None,
    scale_bits: int = DEFAULT_SCALE_BITS,
    session_id: str | None = None,
) -> SecureWeightedMean:
    """Weighted mean of updates (and of scalar losses) over the parties that contribute."""
    if len(weights) != len(updates) or (losses is not None and len(losses) != len(updates)):
        raise ConfigError(
            f"got {len(updates)} updates, {len(weights)} weights and "
            f"{'no' if losses is None else len(losses)} losses; counts must match"
        )
    packed = [
        pack_weighted(u, w, 0.0 if losses is None else losses[i])
        for i, (u, w) in enumerate(zip(updates, weights, strict=True))
    ]
    result = secure_sum(packed, threshold, dropouts, scale_bits, session_id)
    return SecureWeightedMean(
        aggregate=unpack_weighted(result.total), contributors=result.contributors
    )


def _check_vectors(ring_vectors: Sequence[np.ndarray]) -> list[np.ndarray]:
    vectors = [np.asarray(v) for v in ring_vectors]
    if not vectors:
        raise ConfigError("secure sum needs at least one party's vector")
    for i, vector in enumerate(vectors):
        if vector.dtype != np.uint64 or vector.ndim != 1:
            raise ConfigError(
                f"party-{i}: expected a 1-D uint64 vector, got dtype {vector.dtype} "
                f"and shape {vector.shape}"
            )
        if vector.shape != vectors[0].shape:
            raise ConfigError(
                f"party-{i}: vector length {vector.size} differs from party-0's {vectors[0].size}"
            )
    return vectors


def _dropout_schedule(
    dropouts: Mapping[str, Collection[int]] | None, n_parties: int
) -> dict[str, set[int]]:
    schedule = {stage: set() for stage in DROPOUT_STAGES}
    for stage, parties in (dropouts or {}).items():
        if stage not in schedule:
            raise ConfigError(f"unknown dropout stage {stage!r}; use one of {DROPOUT_STAGES}")
        bad = [p for p in parties if not 0 <= p < n_parties]
        if bad:
            raise ConfigError(f"dropout indices {bad} are outside 0..{n_parties - 1}")
        schedule[stage] = set(parties)
    return schedule
