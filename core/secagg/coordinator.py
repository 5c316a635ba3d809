"""The coordinator's steps: relay messages, track who dropped, and unmask only the sum.

The coordinator is untrusted for privacy: it sees public keys, ciphertexts it cannot open,
masked vectors, and at the end exactly one kind of share for each party. Like the party
steps, each function maps ``(state, messages received) -> (new state, messages to send)`` on
plain data so it can be checkpointed and wired into a workflow.

Steps: :func:`start_coordinator` -> :func:`collect_key_advertisements` ->
:func:`route_encrypted_shares` -> :func:`collect_masked_inputs` -> :func:`reconstruct_sum`.
Each step takes whatever messages arrived before its deadline; missing parties are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict

import numpy as np

from core.secagg import keys, shamir
from core.secagg.errors import ProtocolViolationError
from core.secagg.prg import expand_mask
from core.secagg.session import (
    KeyAdvertisement,
    KeyDirectory,
    MaskedInputMessage,
    PublicKeys,
    RingAggregate,
    SessionConfig,
    ShareDelivery,
    ShareKeysMessage,
    UnmaskRequest,
    UnmaskResponse,
    check_config,
    in_session_order,
    mask_sign,
    require_known,
    require_session,
    require_survivors,
    share_point,
)

_PUBLIC_KEY_BYTES = 32
_COMMITMENT_BYTES = 32


class CoordinatorState(TypedDict):
    """Everything the coordinator remembers between steps (plain data, checkpointable)."""

    config: SessionConfig
    stage: str  # collecting_keys -> routing_shares -> collecting_inputs -> unmasking -> done
    public_keys: dict[str, PublicKeys]
    share_senders: list[str]
    self_mask_commitments: dict[str, bytes]
    input_senders: list[str]
    dropped: list[str]
    masked_sum: np.ndarray | None


def start_coordinator(config: SessionConfig) -> CoordinatorState:
    """Initial coordinator state for one session."""
    check_config(config)
    return CoordinatorState(
        config=config,
        stage="collecting_keys",
        public_keys={},
        share_senders=[],
        self_mask_commitments={},
        input_senders=[],
        dropped=[],
        masked_sum=None,
    )


def collect_key_advertisements(
    state: CoordinatorState, advertisements: Sequence[KeyAdvertisement]
) -> tuple[CoordinatorState, KeyDirectory]:
    """Round 0: publish the directory of public keys to every party that advertised."""
    config = state["config"]
    where = "coordinator collect_key_advertisements"
    _require_stage(state, "collecting_keys", where)
    parties = _senders(config, advertisements, where)
    for message in advertisements:
        for field in ("encryption_public_key", "mask_public_key"):
            if len(message[field]) != _PUBLIC_KEY_BYTES:
                raise ProtocolViolationError(
                    f"{where}: party {message['party']!r} sent a {field} of "
                    f"{len(message[field])} bytes, expected {_PUBLIC_KEY_BYTES}"
                )
    require_survivors(config, parties, "advertise keys")
    by_party = {m["party"]: m for m in advertisements}
    public_keys = {
        p: PublicKeys(
            encryption=by_party[p]["encryption_public_key"], mask=by_party[p]["mask_public_key"]
        )
        for p in in_session_order(config, parties)
    }
    new_state: CoordinatorState = {**state, "stage": "routing_shares", "public_keys": public_keys}
    return new_state, KeyDirectory(session_id=config["session_id"], public_keys=public_keys)


def route_encrypted_shares(
    state: CoordinatorState, messages: Sequence[ShareKeysMessage]
) -> tuple[CoordinatorState, dict[str, ShareDelivery]]:
    """Round 1: forward to each share sender the ciphertexts addressed to it."""
    config = state["config"]
    where = "coordinator route_encrypted_shares"
    _require_stage(state, "routing_shares", where)
    senders = in_session_order(config, _senders(config, messages, where))
    advertised = list(state["public_keys"])
    for message in messages:
        sender = message["party"]
        if sender not in advertised:
            raise ProtocolViolationError(f"{where}: party {sender!r} did not advertise keys")
        expected = sorted(p for p in advertised if p != sender)
        if sorted(message["encrypted_shares"]) != expected:
            raise ProtocolViolationError(
                f"{where}: party {sender!r} must send shares to exactly {expected!r}"
            )
        if len(message["self_mask_commitment"]) != _COMMITMENT_BYTES:
            raise ProtocolViolationError(f"{where}: party {sender!r} sent a malformed commitment")
    require_survivors(config, senders, "share keys")
    by_sender = {m["party"]: m for m in messages}
    deliveries = {
        recipient: ShareDelivery(
            session_id=config["session_id"],
            share_senders=senders,
            encrypted_shares={
                s: by_sender[s]["encrypted_shares"][recipient] for s in senders if s != recipient
            },
        )
        for recipient in senders
    }
    new_state: CoordinatorState = {
        **state,
        "stage": "collecting_inputs",
        "share_senders": senders,
        "self_mask_commitments": {s: by_sender[s]["self_mask_commitment"] for s in senders},
    }
    return new_state, deliveries


def collect_masked_inputs(
    state: CoordinatorState, messages: Sequence[MaskedInputMessage]
) -> tuple[CoordinatorState, UnmaskRequest]:
    """Round 2: add up the masked inputs and ask the senders for the shares needed to unmask."""
    config = state["config"]
    where = "coordinator collect_masked_inputs"
    _require_stage(state, "collecting_inputs", where)
    input_senders = in_session_order(config, _senders(config, messages, where))
    masked_sum = np.zeros(config["dimension"], dtype=np.uint64)
    for message in messages:
        sender, vector = message["party"], np.asarray(message["masked_input"])
        if sender not in state["share_senders"]:
            raise ProtocolViolationError(f"{where}: party {sender!r} did not share its keys")
        if vector.dtype != np.uint64 or vector.shape != (config["dimension"],):
            raise ProtocolViolationError(
                f"{where}: party {sender!r} sent dtype {vector.dtype} shape {vector.shape}, "
                f"expected uint64 of length {config['dimension']}"
            )
        np.add(masked_sum, vector, out=masked_sum)
    require_survivors(config, input_senders, "masked input")
    dropped = [p for p in state["share_senders"] if p not in input_senders]
    new_state: CoordinatorState = {
        **state,
        "stage": "unmasking",
        "input_senders": input_senders,
        "dropped": dropped,
        "masked_sum": masked_sum,
    }
    request = UnmaskRequest(
        session_id=config["session_id"], input_senders=input_senders, dropped=dropped
    )
    return new_state, request


def reconstruct_sum(
    state: CoordinatorState, responses: Sequence[UnmaskResponse]
) -> tuple[CoordinatorState, RingAggregate]:
    """Round 3: rebuild self-mask seeds of senders and mask keys of the dropped; remove masks."""
    config = state["config"]
    where = "coordinator reconstruct_sum"
    _require_stage(state, "unmasking", where)
    responders = _senders(config, responses, where)
    input_senders, dropped = state["input_senders"], state["dropped"]
    for response in responses:
        _check_response(response, input_senders, dropped, where)
    require_survivors(config, responders, "unmasking")
    masked_sum = state["masked_sum"]
    assert masked_sum is not None  # set when entering the "unmasking" stage
    total = masked_sum.copy()

    for sender in input_senders:
        seed = _reconstruct(config, responses, "self_mask_seed_shares", sender, where)
        commitment = keys.commit_self_mask_seed(config["session_id"], sender, seed)
        if commitment != state["self_mask_commitments"][sender]:
            raise ProtocolViolationError(
                f"{where}: shares of party {sender!r}'s self-mask seed do not match its "
                "commitment (a responder sent a wrong share)"
            )
        np.subtract(total, expand_mask(seed, config["dimension"]), out=total)

    for gone in dropped:
        mask_key = _reconstruct(config, responses, "mask_key_shares", gone, where)
        if keys.public_key_of(mask_key) != state["public_keys"][gone]["mask"]:
            raise ProtocolViolationError(
                f"{where}: shares of dropped party {gone!r}'s mask key do not match its public "
                "key (a responder sent a wrong share)"
            )
        for sender in input_senders:
            seed = keys.pairwise_mask_seed(
                mask_key, state["public_keys"][sender]["mask"], config["session_id"], gone, sender
            )
            pair_mask = expand_mask(seed, config["dimension"])
            # the sender applied mask_sign(sender, gone) * mask; undo exactly that
            if mask_sign(config, sender, gone) > 0:
                np.subtract(total, pair_mask, out=total)
            else:
                np.add(total, pair_mask, out=total)

    new_state: CoordinatorState = {**state, "stage": "done"}
    result = RingAggregate(
        session_id=config["session_id"], ring_sum=total, input_senders=list(input_senders)
    )
    return new_state, result


def _check_response(
    response: UnmaskResponse, input_senders: list[str], dropped: list[str], where: str
) -> None:
    """Accept only exactly what was asked: one kind of share per party, never both."""
    party = response["party"]
    if party not in input_senders:
        raise ProtocolViolationError(f"{where}: party {party!r} sent no masked input")
    seed_for = set(response["self_mask_seed_shares"])
    key_for = set(response["mask_key_shares"])
    if seed_for & key_for:
        raise ProtocolViolationError(
            f"{where}: refused response of party {party!r}: it holds both kinds of shares for "
            f"{sorted(seed_for & key_for)!r}"
        )
    if seed_for != set(input_senders) or key_for != set(dropped):
        raise ProtocolViolationError(
            f"{where}: party {party!r} must send self-mask-seed shares for {input_senders!r} "
            f"and mask-key shares for {dropped!r}"
        )


def _reconstruct(
    config: SessionConfig,
    responses: Sequence[UnmaskResponse],
    field: Literal["self_mask_seed_shares", "mask_key_shares"],
    owner: str,
    where: str,
) -> bytes:
    shares = {share_point(config, r["party"]): r[field][owner] for r in responses}
    try:
        return shamir.reconstruct_secret(shares, config["threshold"])
    except ValueError as error:
        raise ProtocolViolationError(
            f"{where}: cannot rebuild {field} of {owner!r}: {error}"
        ) from error


def _senders(
    config: SessionConfig, messages: Sequence[Mapping[str, object]], where: str
) -> list[str]:
    """Names of the message senders, refusing unknown parties, repeats and other sessions."""
    parties = [str(m["party"]) for m in messages]
    require_known(config, parties, where)
    for message in messages:
        require_session(config, str(message["session_id"]), f"{where} (party {message['party']!r})")
    return parties


def _require_stage(state: CoordinatorState, expected: str, where: str) -> None:
    if state["stage"] != expected:
        raise ProtocolViolationError(
            f"{where}: needs stage {expected!r}, but the coordinator is at {state['stage']!r}"
        )
