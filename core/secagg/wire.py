"""Plain-value forms of :mod:`core.secagg.multiround`'s messages and states.

Why: messages cross the channel and states sit (sealed) in a party's store through the safe
codec, which carries only None, numbers, strings, bytes, lists, string-keyed dicts and numpy
arrays. Each ``*_to_plain`` has an inverse that rebuilds the frozen dataclass exactly (tuples
stay tuples), so a state read back after a restart compares equal to the one stored and an
identical retried request is recognised as identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from core.secagg import multiround as mr
from core.secagg.errors import ProtocolViolationError

Plain = dict[str, Any]


def _names(values: Any, what: str) -> tuple[str, ...]:
    if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values):
        raise ProtocolViolationError(f"{what}: expected a list of party names")
    return tuple(values)


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolViolationError(f"{what}: expected a mapping by party name")
    return value


def config_to_plain(config: mr.JobConfig) -> Plain:
    return {
        "job_id": config.job_id,
        "parties": list(config.parties),
        "neighbours": {p: list(n) for p, n in config.neighbours.items()},
        "threshold": config.threshold,
        "min_senders": config.min_senders,
        "dimension": config.dimension,
        "scale_bits": config.scale_bits,
    }


def config_from_plain(plain: Plain) -> mr.JobConfig:
    return mr.JobConfig(
        plain["job_id"],
        tuple(plain["parties"]),
        {p: tuple(n) for p, n in plain["neighbours"].items()},
        int(plain["threshold"]),
        int(plain["min_senders"]),
        int(plain["dimension"]),
        int(plain["scale_bits"]),
    )


def keys_to_plain(keys: mr.PeerKeys) -> list[Any]:
    return [keys.epoch, keys.public]


def keys_from_plain(plain: Any, what: str = "keys") -> mr.PeerKeys:
    if (
        not isinstance(plain, list)
        or len(plain) != 2
        or not isinstance(plain[0], int)
        or not isinstance(plain[1], bytes)
    ):
        raise ProtocolViolationError(f"{what}: expected [epoch, public key bytes]")
    return mr.PeerKeys(plain[0], plain[1])


def advertisement_to_plain(ad: mr.KeyAdvertisement) -> Plain:
    return {"job_id": ad.job_id, "party": ad.party, "keys": keys_to_plain(ad.keys)}


def advertisement_from_plain(plain: Any, sender: str) -> mr.KeyAdvertisement:
    what = f"key advertisement of {sender!r}"
    message = _mapping(plain, what)
    if message.get("party") != sender:
        raise ProtocolViolationError(f"{what}: it names party {message.get('party')!r}")
    return mr.KeyAdvertisement(
        str(message["job_id"]), sender, keys_from_plain(message["keys"], what)
    )


def masked_to_plain(message: mr.MaskedInput) -> Plain:
    return {
        "job_id": message.job_id,
        "round": message.round,
        "party": message.party,
        "epoch": message.epoch,
        "masked": message.masked,
        "shares": dict(message.shares),
        "commitment": message.commitment,
    }


def masked_from_plain(plain: Any, sender: str) -> mr.MaskedInput:
    what = f"masked input of {sender!r}"
    message = _mapping(plain, what)
    if message.get("party") != sender:  # the channel authenticated the sender, not the body
        raise ProtocolViolationError(f"{what}: it names party {message.get('party')!r}")
    masked = message.get("masked")
    if not isinstance(masked, np.ndarray):
        raise ProtocolViolationError(f"{what}: no masked vector")
    return mr.MaskedInput(
        str(message["job_id"]),
        int(message["round"]),
        sender,
        int(message["epoch"]),
        masked,
        dict(_mapping(message["shares"], what)),
        bytes(message["commitment"]),
    )


def request_to_plain(request: mr.UnmaskRequest) -> Plain:
    return {
        "job_id": request.job_id,
        "round": request.round,
        "senders": list(request.senders),
        "dropped": list(request.dropped),
        "shares": dict(request.shares),
    }


def request_from_plain(plain: Any) -> mr.UnmaskRequest:
    what = "unmask request"
    message = _mapping(plain, what)
    return mr.UnmaskRequest(
        str(message["job_id"]),
        int(message["round"]),
        _names(message["senders"], what),
        _names(message["dropped"], what),
        dict(_mapping(message["shares"], what)),
    )


def view_to_plain(view: mr.SurvivorView) -> Plain:
    return {
        "job_id": view.job_id,
        "round": view.round,
        "party": view.party,
        "senders": list(view.senders),
        "dropped": list(view.dropped),
    }


def view_from_plain(plain: Any, sender: str) -> mr.SurvivorView:
    what = f"survivor view of {sender!r}"
    message = _mapping(plain, what)
    if message.get("party") != sender:
        raise ProtocolViolationError(f"{what}: it names party {message.get('party')!r}")
    return mr.SurvivorView(
        str(message["job_id"]),
        int(message["round"]),
        sender,
        _names(message["senders"], what),
        _names(message["dropped"], what),
    )


def response_to_plain(response: mr.UnmaskResponse) -> Plain:
    return {
        "job_id": response.job_id,
        "round": response.round,
        "party": response.party,
        "self_mask_shares": dict(response.self_mask_shares),
        "pair_seeds": dict(response.pair_seeds),
    }


def response_from_plain(plain: Any, sender: str) -> mr.UnmaskResponse:
    what = f"unmask response of {sender!r}"
    message = _mapping(plain, what)
    if message.get("party") != sender:
        raise ProtocolViolationError(f"{what}: it names party {message.get('party')!r}")
    return mr.UnmaskResponse(
        str(message["job_id"]),
        int(message["round"]),
        sender,
        dict(_mapping(message["self_mask_shares"], what)),
        dict(_mapping(message["pair_seeds"], what)),
    )


def party_state_to_plain(state: mr.JobPartyState) -> Plain:
    """Everything a party needs to go on after a restart (its private key included: store
    it sealed only)."""
    masked = state.masked
    answered = state.answered
    return {
        "config": config_to_plain(state.config),
        "party": state.party,
        "epoch": state.epoch,
        "private_key": state.private_key,
        "own_keys": keys_to_plain(state.own_keys),
        "peers": {
            p: [keys_to_plain(s.keys), s.pair_secret, s.share_key] for p, s in state.peers.items()
        },
        "round": state.round,
        "active": list(state.active),
        "masked": None
        if masked is None
        else [masked.round, list(masked.senders_possible), masked.own_share],
        "last_masked": state.last_masked,
        "answered": None
        if answered is None
        else [request_to_plain(answered[0]), response_to_plain(answered[1])],
        "out": state.out,
        "viewed": None if state.viewed is None else request_to_plain(state.viewed),
    }


def party_state_from_plain(plain: Plain) -> mr.JobPartyState:
    masked, answered = plain["masked"], plain["answered"]
    party = plain["party"]
    return mr.JobPartyState(
        config_from_plain(plain["config"]),
        party,
        int(plain["epoch"]),
        plain["private_key"],
        keys_from_plain(plain["own_keys"]),
        {
            p: mr.PeerSecrets(keys_from_plain(k), secret, share)
            for p, (k, secret, share) in plain["peers"].items()
        },
        int(plain["round"]),
        tuple(plain["active"]),
        None if masked is None else mr.MaskedRound(masked[0], tuple(masked[1]), masked[2]),
        int(plain["last_masked"]),
        None
        if answered is None
        else (request_from_plain(answered[0]), response_from_plain(answered[1], party)),
        bool(plain["out"]),
        None if plain.get("viewed") is None else request_from_plain(plain["viewed"]),
    )


def coordinator_state_to_plain(state: mr.JobCoordinatorState) -> Plain:
    return {
        "config": config_to_plain(state.config),
        "keys": {p: keys_to_plain(k) for p, k in state.keys.items()},
        "active": list(state.active),
        "round": state.round,
        "stage": state.stage,
        "senders": list(state.senders),
        "dropped": list(state.dropped),
        "commitments": dict(state.commitments),
        "masked_sum": state.masked_sum,
    }


def coordinator_state_from_plain(plain: Plain) -> mr.JobCoordinatorState:
    return mr.JobCoordinatorState(
        config_from_plain(plain["config"]),
        {p: keys_from_plain(k) for p, k in plain["keys"].items()},
        tuple(plain["active"]),
        int(plain["round"]),
        str(plain["stage"]),
        tuple(plain["senders"]),
        tuple(plain["dropped"]),
        dict(plain["commitments"]),
        plain["masked_sum"],
    )
