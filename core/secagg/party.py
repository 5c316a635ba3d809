"""One party's steps of secure aggregation with dropout recovery (Bonawitz et al. 2017).

Each step is a pure function ``(state, incoming message) -> (new state, outgoing message)``
on plain data, so it can run as one task of a workflow and the state can be checkpointed in
the party's own database between steps. Persist the returned state *before* sending the
message: re-running :func:`mask_input` from an older checkpoint with a different vector would
give the coordinator two inputs masked identically, i.e. their difference.

Steps: :func:`advertise_keys` -> :func:`share_keys` -> :func:`mask_input` ->
:func:`reveal_shares`.
"""

from __future__ import annotations

import secrets
from typing import TypedDict

import numpy as np

from core.secagg import keys, shamir
from core.secagg.errors import ProtocolViolationError
from core.secagg.fixed_point import encode
from core.secagg.prg import expand_mask
from core.secagg.session import (
    KeyAdvertisement,
    KeyDirectory,
    MaskedInputMessage,
    PublicKeys,
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


class HeldShares(TypedDict):
    """This party's Shamir shares of another party's two secrets."""

    mask_key: int
    self_mask_seed: int


class PartyState(TypedDict):
    """Everything a party must remember between steps (plain data, checkpointable)."""

    config: SessionConfig
    party: str
    stage: str  # advertised -> shared -> masked -> revealed
    encryption_private_key: bytes
    mask_private_key: bytes
    self_mask_seed: bytes | None
    public_keys: dict[str, PublicKeys]
    share_senders: list[str]
    held_shares: dict[str, HeldShares]
    unmask_request: UnmaskRequest | None
    unmask_response: UnmaskResponse | None


def advertise_keys(config: SessionConfig, party: str) -> tuple[PartyState, KeyAdvertisement]:
    """Round 0: create two fresh X25519 key pairs and publish the public halves."""
    check_config(config)
    require_known(config, [party], "advertise_keys")
    encryption_private, encryption_public = keys.new_key_pair()
    mask_private, mask_public = keys.new_key_pair()
    state = PartyState(
        config=config,
        party=party,
        stage="advertised",
        encryption_private_key=encryption_private,
        mask_private_key=mask_private,
        self_mask_seed=None,
        public_keys={},
        share_senders=[],
        held_shares={},
        unmask_request=None,
        unmask_response=None,
    )
    message = KeyAdvertisement(
        session_id=config["session_id"],
        party=party,
        encryption_public_key=encryption_public,
        mask_public_key=mask_public,
    )
    return state, message


def share_keys(state: PartyState, directory: KeyDirectory) -> tuple[PartyState, ShareKeysMessage]:
    """Round 1: Shamir-share the mask key and a new self-mask seed, encrypted per recipient."""
    config, party = state["config"], state["party"]
    where = f"party {party!r} share_keys"
    _require_stage(state, "advertised", "share_keys")
    require_session(config, directory["session_id"], where)
    public_keys = directory["public_keys"]
    recipients = in_session_order(config, _known(config, list(public_keys), where))
    own_keys = public_keys.get(party)
    if own_keys != PublicKeys(
        encryption=keys.public_key_of(state["encryption_private_key"]),
        mask=keys.public_key_of(state["mask_private_key"]),
    ):
        raise ProtocolViolationError(f"{where}: the directory does not carry this party's own keys")
    require_survivors(config, recipients, where)

    self_mask_seed = secrets.token_bytes(shamir.SECRET_BYTES)
    points = {v: share_point(config, v) for v in recipients}
    threshold = config["threshold"]
    key_shares = shamir.split_secret(state["mask_private_key"], list(points.values()), threshold)
    seed_shares = shamir.split_secret(self_mask_seed, list(points.values()), threshold)

    held: dict[str, HeldShares] = {}
    encrypted: dict[str, bytes] = {}
    for recipient, point in points.items():
        bundle = HeldShares(mask_key=key_shares[point], self_mask_seed=seed_shares[point])
        if recipient == party:
            held[party] = bundle
            continue
        key = keys.share_encryption_key(
            state["encryption_private_key"],
            public_keys[recipient]["encryption"],
            config["session_id"],
            party,
            recipient,
        )
        encrypted[recipient] = keys.encrypt_share_bundle(
            key, config["session_id"], party, recipient, _bundle_to_bytes(bundle)
        )
    new_state: PartyState = {
        **state,
        "stage": "shared",
        "self_mask_seed": self_mask_seed,
        "public_keys": {v: PublicKeys(**public_keys[v]) for v in recipients},
        "held_shares": held,
    }
    message = ShareKeysMessage(
        session_id=config["session_id"],
        party=party,
        encrypted_shares=encrypted,
        self_mask_commitment=keys.commit_self_mask_seed(
            config["session_id"], party, self_mask_seed
        ),
    )
    return new_state, message


def mask_input(
    state: PartyState, delivery: ShareDelivery, values: np.ndarray
) -> tuple[PartyState, MaskedInputMessage]:
    """Round 2 for float vectors: fixed-point encode, then :func:`mask_ring_input`."""
    config = state["config"]
    ring_values = encode(
        values, len(config["parties"]), config["scale_bits"], party=f"party {state['party']!r}"
    )
    return mask_ring_input(state, delivery, ring_values)


def mask_ring_input(
    state: PartyState, delivery: ShareDelivery, ring_values: np.ndarray
) -> tuple[PartyState, MaskedInputMessage]:
    """Round 2: keep the shares addressed to us, and send y = x + PRG(b) + sum of +-PRG(s_uv)."""
    config, party = state["config"], state["party"]
    where = f"party {party!r} mask_input"
    _require_stage(state, "shared", "mask_input")
    require_session(config, delivery["session_id"], where)
    senders = in_session_order(config, _known(config, delivery["share_senders"], where))
    unexpected = [v for v in senders if v not in state["public_keys"]]
    if party not in senders or unexpected:
        raise ProtocolViolationError(
            f"{where}: share senders must include this party and only parties that advertised "
            f"keys; got {senders!r}"
        )
    require_survivors(config, senders, where)
    peers = [v for v in senders if v != party]
    if sorted(delivery["encrypted_shares"]) != sorted(peers):
        raise ProtocolViolationError(
            f"{where}: expected encrypted shares from exactly {peers!r}, "
            f"got {sorted(delivery['encrypted_shares'])!r}"
        )
    ring = np.asarray(ring_values)
    if ring.dtype != np.uint64 or ring.shape != (config["dimension"],):
        raise ProtocolViolationError(
            f"{where}: input must be a uint64 vector of length {config['dimension']}, "
            f"got dtype {ring.dtype} and shape {ring.shape}"
        )

    held = dict(state["held_shares"])
    for sender in peers:
        held[sender] = _open_bundle(state, sender, delivery["encrypted_shares"][sender])

    seed = state["self_mask_seed"]
    assert seed is not None  # guaranteed by the "shared" stage
    masked = ring + expand_mask(seed, config["dimension"])
    for peer in peers:
        pair_seed = keys.pairwise_mask_seed(
            state["mask_private_key"],
            state["public_keys"][peer]["mask"],
            config["session_id"],
            party,
            peer,
        )
        pair_mask = expand_mask(pair_seed, config["dimension"])
        if mask_sign(config, party, peer) > 0:
            np.add(masked, pair_mask, out=masked)
        else:
            np.subtract(masked, pair_mask, out=masked)

    new_state: PartyState = {
        **state,
        "stage": "masked",
        "share_senders": senders,
        "held_shares": held,
    }
    message = MaskedInputMessage(session_id=config["session_id"], party=party, masked_input=masked)
    return new_state, message


def reveal_shares(state: PartyState, request: UnmaskRequest) -> tuple[PartyState, UnmaskResponse]:
    """Round 3: reveal self-mask-seed shares of input senders, mask-key shares of the dropped.

    Refuses any request that would give the coordinator both secrets of one party, including a
    second, different request after answering one. An identical retry gets the same answer.
    """
    config, party = state["config"], state["party"]
    where = f"party {party!r} reveal_shares"
    if state["stage"] == "revealed":
        if _same_request(state["unmask_request"], request):
            assert state["unmask_response"] is not None
            return state, state["unmask_response"]
        raise ProtocolViolationError(
            f"{where}: already answered a different unmask request in this session; answering "
            "again could reveal both secrets of one party"
        )
    _require_stage(state, "masked", "reveal_shares")
    require_session(config, request["session_id"], where)
    input_senders = _known(config, request["input_senders"], where)
    dropped = _known(config, request["dropped"], where)
    both = sorted(set(input_senders) & set(dropped))
    if both:
        raise ProtocolViolationError(
            f"{where}: refused, parties {both!r} are listed both as input senders and as "
            "dropped; revealing both kinds of shares would unmask their inputs"
        )
    if party not in input_senders:
        raise ProtocolViolationError(
            f"{where}: refused, this party sent its masked input but the request lists it as "
            "dropped or absent"
        )
    if sorted(input_senders + dropped) != sorted(state["share_senders"]):
        raise ProtocolViolationError(
            f"{where}: input senders plus dropped parties must be exactly the share senders "
            f"{state['share_senders']!r}"
        )
    require_survivors(config, input_senders, where)

    held = state["held_shares"]
    response = UnmaskResponse(
        session_id=config["session_id"],
        party=party,
        self_mask_seed_shares={v: held[v]["self_mask_seed"] for v in input_senders},
        mask_key_shares={v: held[v]["mask_key"] for v in dropped},
    )
    remembered = UnmaskRequest(
        session_id=request["session_id"],
        input_senders=in_session_order(config, input_senders),
        dropped=in_session_order(config, dropped),
    )
    new_state: PartyState = {
        **state,
        "stage": "revealed",
        "unmask_request": remembered,
        "unmask_response": response,
    }
    return new_state, response


def _require_stage(state: PartyState, expected: str, step: str) -> None:
    if state["stage"] != expected:
        raise ProtocolViolationError(
            f"party {state['party']!r}: {step} needs stage {expected!r}, "
            f"but the party is at stage {state['stage']!r}"
        )


def _known(config: SessionConfig, parties: list[str], where: str) -> list[str]:
    require_known(config, parties, where)
    return list(parties)


def _same_request(previous: UnmaskRequest | None, request: UnmaskRequest) -> bool:
    return previous is not None and (
        previous["session_id"] == request["session_id"]
        and sorted(previous["input_senders"]) == sorted(request["input_senders"])
        and sorted(previous["dropped"]) == sorted(request["dropped"])
    )


def _open_bundle(state: PartyState, sender: str, ciphertext: bytes) -> HeldShares:
    config, party = state["config"], state["party"]
    key = keys.share_encryption_key(
        state["encryption_private_key"],
        state["public_keys"][sender]["encryption"],
        config["session_id"],
        party,
        sender,
    )
    plaintext = keys.decrypt_share_bundle(key, config["session_id"], sender, party, ciphertext)
    if len(plaintext) != 2 * shamir.SHARE_BYTES:
        raise ProtocolViolationError(f"shares from party {sender!r} have the wrong length")
    return HeldShares(
        mask_key=shamir.share_from_bytes(plaintext[: shamir.SHARE_BYTES]),
        self_mask_seed=shamir.share_from_bytes(plaintext[shamir.SHARE_BYTES :]),
    )


def _bundle_to_bytes(bundle: HeldShares) -> bytes:
    return shamir.share_to_bytes(bundle["mask_key"]) + shamir.share_to_bytes(
        bundle["self_mask_seed"]
    )
