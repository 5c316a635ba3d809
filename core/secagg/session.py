"""Session configuration and the plain-data messages exchanged in one aggregation round.

Every message is a ``TypedDict`` of bytes, ints, strings, lists, dicts and numpy arrays, so a
transport (a Prefect task result, a queue, a database row) can carry it without custom types.

One session aggregates one vector. Keys, seeds and shares are fresh per session: re-using a
session after a party was declared dropped would let the coordinator unmask that party later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import numpy as np

from core.secagg.errors import ConfigError, InsufficientSurvivorsError, ProtocolViolationError
from core.secagg.fixed_point import DEFAULT_SCALE_BITS, MAX_SCALE_BITS


class SessionConfig(TypedDict):
    """Agreed by all parties before the round starts (e.g. part of the job definition)."""

    session_id: str
    parties: list[str]  # the order fixes mask signs and Shamir share points
    threshold: int
    dimension: int
    scale_bits: int


class PublicKeys(TypedDict):
    encryption: bytes
    mask: bytes


class KeyAdvertisement(TypedDict):
    """Round 0, party -> coordinator."""

    session_id: str
    party: str
    encryption_public_key: bytes
    mask_public_key: bytes


class KeyDirectory(TypedDict):
    """Round 0 answer, coordinator -> every party that advertised."""

    session_id: str
    public_keys: dict[str, PublicKeys]


class ShareKeysMessage(TypedDict):
    """Round 1, party -> coordinator: shares encrypted to each other party, plus a commitment."""

    session_id: str
    party: str
    encrypted_shares: dict[str, bytes]  # recipient -> AEAD ciphertext
    self_mask_commitment: bytes


class ShareDelivery(TypedDict):
    """Round 1 answer, coordinator -> each party that shared: the ciphertexts addressed to it."""

    session_id: str
    share_senders: list[str]
    encrypted_shares: dict[str, bytes]  # sender -> AEAD ciphertext


class MaskedInputMessage(TypedDict):
    """Round 2, party -> coordinator."""

    session_id: str
    party: str
    masked_input: np.ndarray  # uint64, length = dimension


class UnmaskRequest(TypedDict):
    """Round 2 answer, coordinator -> every party that sent a masked input."""

    session_id: str
    input_senders: list[str]
    dropped: list[str]  # shared keys but sent no masked input


class UnmaskResponse(TypedDict):
    """Round 3, party -> coordinator: exactly one kind of share per party, never both."""

    session_id: str
    party: str
    self_mask_seed_shares: dict[str, int]  # for every input sender
    mask_key_shares: dict[str, int]  # for every dropped party


class RingAggregate(TypedDict):
    """Result of a round: the exact ring sum of the input senders' vectors."""

    session_id: str
    ring_sum: np.ndarray
    input_senders: list[str]


def new_session(
    session_id: str,
    parties: Sequence[str],
    threshold: int,
    dimension: int,
    scale_bits: int = DEFAULT_SCALE_BITS,
) -> SessionConfig:
    """Validated configuration for one aggregation round."""
    config = SessionConfig(
        session_id=session_id,
        parties=list(parties),
        threshold=threshold,
        dimension=dimension,
        scale_bits=scale_bits,
    )
    check_config(config)
    return config


def check_config(config: SessionConfig) -> None:
    """Refuse configurations that are unsafe or cannot work.

    The threshold must exceed half the parties: each honest party answers one unmask request
    only, so two disjoint groups of ``threshold`` parties (one revealing a party's self-mask
    seed, the other its mask key) cannot both exist.
    """
    parties = config["parties"]
    if not config["session_id"]:
        raise ConfigError("session_id must be a non-empty string, unique for every round")
    if not parties:
        raise ConfigError("a session needs at least one party")
    bad_names = [p for p in parties if not isinstance(p, str) or not p]
    if bad_names:
        raise ConfigError(f"party names must be non-empty strings, got {bad_names!r}")
    duplicates = sorted({p for p in parties if parties.count(p) > 1})
    if duplicates:
        raise ConfigError(f"party names must be unique; repeated: {duplicates}")
    n, threshold = len(parties), config["threshold"]
    if not n // 2 < threshold <= n:
        raise ConfigError(
            f"threshold {threshold} must satisfy {n // 2} < threshold <= {n} for {n} parties "
            "(more than half, so no two disjoint groups can unmask one party)"
        )
    if config["dimension"] < 1:
        raise ConfigError(f"dimension must be positive, got {config['dimension']}")
    if not 0 <= config["scale_bits"] <= MAX_SCALE_BITS:
        raise ConfigError(
            f"scale_bits must be in [0, {MAX_SCALE_BITS}], got {config['scale_bits']}"
        )


def default_threshold(n_parties: int) -> int:
    """Smallest threshold accepted: a strict majority of the parties."""
    return n_parties // 2 + 1


def share_point(config: SessionConfig, party: str) -> int:
    """Shamir x-coordinate of ``party``: its 1-based position in the session."""
    return config["parties"].index(party) + 1


def mask_sign(config: SessionConfig, own: str, peer: str) -> int:
    """+1 if ``own`` adds the pairwise mask shared with ``peer``, -1 if it subtracts it."""
    return 1 if share_point(config, own) < share_point(config, peer) else -1


def in_session_order(config: SessionConfig, parties: Sequence[str]) -> list[str]:
    """``parties`` sorted by their position in the session (canonical order for messages)."""
    return sorted(parties, key=lambda p: share_point(config, p))


def require_known(config: SessionConfig, parties: Sequence[str], where: str) -> None:
    """Refuse party names that are not part of the session."""
    unknown = [p for p in parties if p not in config["parties"]]
    if unknown:
        raise ProtocolViolationError(f"{where}: unknown parties {unknown!r}")
    repeated = sorted({p for p in parties if list(parties).count(p) > 1})
    if repeated:
        raise ProtocolViolationError(f"{where}: parties listed more than once: {repeated!r}")


def require_session(config: SessionConfig, message_session: str, where: str) -> None:
    """Refuse messages from another round (replays across sessions)."""
    if message_session != config["session_id"]:
        raise ProtocolViolationError(
            f"{where}: message belongs to session {message_session!r}, "
            f"expected {config['session_id']!r}"
        )


def require_survivors(config: SessionConfig, survivors: Sequence[str], stage: str) -> None:
    """Abort the round when fewer than ``threshold`` parties are left."""
    if len(survivors) < config["threshold"]:
        raise InsufficientSurvivorsError(
            f"{stage}: only {len(survivors)} of {len(config['parties'])} parties remain "
            f"({sorted(survivors)}), fewer than the threshold {config['threshold']}; "
            "the round is aborted and nothing is revealed"
        )
