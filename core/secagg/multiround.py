"""Secure aggregation over many rounds: keys agreed once per job, masks derived per round.

Why: the single-session protocol (:mod:`core.secagg.party`) spends four message exchanges and
fresh key agreements on every round, though a round's own work is one masked vector per
party. Here a party agrees its pairwise secrets with its neighbours once per job (or once per
*key epoch*: a party re-keys when it rejoins), and a round is two exchanges:

====================  ===========================================  =====================
step (sender)          message                                      to
====================  ===========================================  =====================
join / rekey (P)       KeyAdvertisement: X25519 key, epoch          coordinator (once)
open_round (C)         RoundStart: active parties, neighbours' keys every active party
mask_round (P)         MaskedInput: y = x + PRG(b) +- PRG(s_uv,r),  coordinator
                       b's Shamir shares encrypted per neighbour
collect_inputs (C)     UnmaskRequest: senders, dropped, shares      every sender
sign_view (P)          SurvivorView: the senders and dropped it     coordinator, relayed
                       was told, signed by its channel              to every sender
collect_views (C)      the signed views, each with its proof        every sender
answer_unmask (P)      UnmaskResponse: b shares, round seeds of     coordinator
                       dropped neighbours (after >= quorum views)
unmask (C)             RoundSum: the exact ring sum                 (result)
====================  ===========================================  =====================

Neighbours are those of a SecAgg+ graph (:mod:`core.secagg.graph`, complete for a few
parties); every step is a pure function ``(state, message) -> (state, message)`` on frozen
dataclasses, like the single-session steps. The view exchange is the ConsistencyCheck round
of Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning"
(CCS 2017, Figure 4, round 3), which Bell et al. (CCS 2020, SecAgg+) keep: a sender reveals
nothing until it holds :func:`view_quorum` signatures on the survivor set it was told.
Signatures are the channel's (:mod:`tasks.secure_rounds`): each view goes to the coordinator
signed by its sender's certificate, and the coordinator relays all of them to every sender
with those proofs; the steps here take the views as authenticated and compare them.

Why it is as safe as the per-round protocol (the argument, step by step):

1. *Round masks are independent across rounds.* The pair secret ``s_uv`` (X25519 + HKDF,
   bound to job, pair and both key epochs) is never sent to anyone. Round r's pair seed is
   ``HMAC-SHA256(s_uv, job, r)``, a PRF output: learning it for one round tells nothing about
   any other round's seed. A dropped party u is unmasked out of the sum by its *neighbours*
   revealing their round-r seeds with u, so only that round's pair seeds of u are ever
   revealed, never ``s_uv`` and never u's private key (nothing per-job is Shamir-shared).
2. *Self-masks are fresh per round.* Each round a party draws a new self-mask seed ``b`` from
   the OS CSPRNG and sends its t-of-(k + 1) shares (encrypted to its neighbours) with its
   masked input; revealing one round's ``b`` (as happens for every sender) reveals no other
   round's, since they are independent.
3. *No mask covers two inputs.* A party masks each round at most once and rounds only go
   forward (:func:`mask_round` refuses an earlier or repeated round; store the returned state
   before sending), and round seeds differ per round, so no (seed, round) pair ever masks two
   different vectors. A party left out of a round (dropped: its round seeds were revealed)
   is *out* of the session: it must :func:`rekey` (fresh key pairs, a higher epoch, the old
   private keys gone) and be admitted again before it contributes, so it cannot later be
   asked for an input of a round whose seeds are out. A coordinator that still gets a
   dropped party's late input for that round cannot unmask it: it would need that round's
   self-mask ``b``, whose shares are held by the same neighbours that revealed the seeds,
   and each party signs one view and answers one request per round (a different second
   request is refused, :func:`sign_view`, :func:`answer_unmask`).
4. *One story per round.* To unmask one sender u the coordinator needs t shares of u's
   ``b`` (revealed only by holders told "u sent", u's own among them) *and* every round
   seed of u's pairs with senders (revealed by u only for a neighbour it was told dropped,
   by a neighbour only when told u dropped). Requests are built per recipient, so without a
   check it could tell u that t - 1 neighbours D dropped (u reveals its seeds with D), tell
   D the truth (they reveal their shares of ``b``), and tell u's other neighbours that u
   dropped (they reveal their seeds with u): u's input in the clear, no colluder needed.
   Here no sender reveals anything before it holds :func:`view_quorum` signed views, by
   distinct senders of its request, each *identical* to its own (:func:`answer_unmask`);
   an honest party signs one view a round (:func:`sign_view`). The quorum is at least
   ``min_senders``, a strict majority of all parties, so two different views with a quorum
   each share a signer: without a colluding party the coordinator cannot get two honest
   parties to answer different stories, and the attack above is refused by u, D and the
   others before any secret leaves them, naming the coordinator (tested at 3, 10 and 20
   parties). Under one agreed view a sender is never dropped: no honest party reveals a seed
   with it, it reveals its own seeds only with neighbours that view lists as dropped (who
   signed nothing that counts), and a dropped party's ``b`` is never asked for.
5. *Colluders.* c colluding parties may sign two views; a split then needs c >= 2 *
   ``min_senders`` - n (so at least 1 with the default strict majority, more with a higher
   ``threshold``), and even split, one input is revealed only if t - 1 of its neighbours
   collude (its ``b`` needs t shares, u's own and t - 1 more from holders that also told the
   other story): tested at t - 1 and below. The graph bounds (event A and B of
   :mod:`core.secagg.graph`) make t - 1 colluding neighbours, and a disconnected honest
   remainder (which would reveal partial sums), unlikely below the stated probability.
6. *The terms are the job's, not the coordinator's.* ``threshold``, ``min_senders`` and the
   party set are fixed in :class:`JobConfig` once a party has masked a round; given the
   party's own options when it joins (``party_join(..., agreed=True)``),
   :mod:`tasks.secure_rounds` stores them with the stage timeout and refuses any call that
   states others, naming the coordinator (a lowered threshold lowers the quorum and the
   shares needed).
7. *Restarts change nothing of this* when each holder stores the state a step returns, with
   the message it sends, before sending (:mod:`tasks.secure_rounds` does, sealed under the
   job's key file): a restarted party re-sends the stored masked input, view or answer
   instead of masking, signing or answering again, and a restarted coordinator re-sends its
   stored unmask requests, so a round is never unmasked for a second set of senders.
8. *The coordinator's sum can be checked by every sender that answered*: it runs
   :func:`collect_inputs` and :func:`unmask` itself on the round's masked inputs and answers
   (it then knows the sum, the coordinator's view, and nothing more: the masks it cannot
   remove alone are the same). It needs them exactly as their senders sent them, and gets
   them through the coordinator's relay (:mod:`tasks.secure_rounds`), each entry with its
   sender's proof of what it sent (its signature of job, round, sender, receiver, kind and
   digest over the network): a coordinator can drop, alter, swap or replay no entry without
   the check refusing the round, naming the sender, as if each party had sent its peers
   copies directly. (This check comes after the answers; it is point 4 that keeps the
   answers themselves safe.)

Why the unmask exchange runs every round, not only after a dropout: a round without self-masks
would be unmasked by the pair masks cancelling alone, but then a coordinator that declares a
slow party dropped, collects its neighbours' round seeds and then reads its late input has
that input in the clear. The self-mask closes this (point 3) at the cost of one short
exchange per round; the pair masks, the expensive part, are never re-agreed.

Dropout tolerance: any party may drop before masking; a sender may drop before signing its
view or before unmasking while :func:`view_quorum` senders sign and t of its holders answer,
except when it neighbours a party that dropped before masking (their round seed is then
known only to the two of them): the round is refused then, naming both, and nothing beyond
masked partial sums was revealed (each honest remaining sender still has an unrevealed seed
with another sender).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from core.secagg import keys, shamir
from core.secagg.errors import ConfigError, InsufficientSurvivorsError, ProtocolViolationError
from core.secagg.fixed_point import DEFAULT_SCALE_BITS, MAX_SCALE_BITS, encode
from core.secagg.graph import (
    GraphParameters,
    NeighbourGraph,
    choose_parameters,
    graph_seed,
    harary_graph,
)
from core.secagg.prg import apply_mask

_LABEL = "privreg/secagg/multiround/v1"
_NONCE_BYTES = 12
_LABEL_PREFIX = len(_LABEL.encode()).to_bytes(4, "big") + _LABEL.encode()


# ---------------------------------------------------------------------------------------------
# Configuration and messages


@dataclass(frozen=True)
class JobConfig:
    """What every party of a job agrees on before the first round (non-secret)."""

    job_id: str
    parties: tuple[str, ...]  # the order fixes Shamir points and mask signs
    neighbours: Mapping[str, tuple[str, ...]]
    threshold: int  # self-mask shares needed among a party's k + 1 holders
    min_senders: int  # fewest senders whose sum may be revealed
    dimension: int
    scale_bits: int = DEFAULT_SCALE_BITS
    positions: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "positions", {p: i + 1 for i, p in enumerate(self.parties)})

    def holders(self, party: str) -> tuple[str, ...]:
        """Who holds shares of ``party``'s self-mask: itself and its neighbours."""
        return (party, *self.neighbours[party])

    def sign(self, own: str, peer: str) -> int:
        """+1 if ``own`` adds the pair mask it shares with ``peer``, -1 if it subtracts it."""
        return 1 if self.positions[own] < self.positions[peer] else -1


@dataclass(frozen=True)
class PeerKeys:
    """A party's public X25519 key of one key epoch."""

    epoch: int
    public: bytes


@dataclass(frozen=True)
class KeyAdvertisement:
    """Party -> coordinator, once per key epoch (the job's start, or a rejoin)."""

    job_id: str
    party: str
    keys: PeerKeys


@dataclass(frozen=True)
class RoundStart:
    """Coordinator -> each active party: the round's active set and its neighbours' keys."""

    job_id: str
    round: int
    active: tuple[str, ...]
    keys: Mapping[str, PeerKeys]  # the recipient's own and its active neighbours'


@dataclass(frozen=True)
class MaskedInput:
    """Party -> coordinator: the masked vector and this round's self-mask shares."""

    job_id: str
    round: int
    party: str
    epoch: int
    masked: np.ndarray
    shares: Mapping[str, bytes]  # active neighbour -> AEAD ciphertext of its share
    commitment: bytes  # hash of the self-mask seed, to detect a wrong share


@dataclass(frozen=True)
class UnmaskRequest:
    """Coordinator -> each sender: who sent and who dropped; the shares addressed to it."""

    job_id: str
    round: int
    senders: tuple[str, ...]
    dropped: tuple[str, ...]  # active this round, sent nothing
    shares: Mapping[str, bytes]  # sending neighbour -> ciphertext for the recipient


@dataclass(frozen=True)
class SurvivorView:
    """Sender -> coordinator -> every sender (Bonawitz et al. 2017, round 3, ConsistencyCheck):
    the survivor and dropped sets the coordinator told ``party``, signed by ``party``'s
    channel (over mTLS its certificate's signature; the relay carries it as the proof)."""

    job_id: str
    round: int
    party: str
    senders: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class UnmaskResponse:
    """Sender -> coordinator: one kind of secret per neighbour, never both."""

    job_id: str
    round: int
    party: str
    self_mask_shares: Mapping[str, int]  # itself and every sending neighbour
    pair_seeds: Mapping[str, bytes]  # every dropped neighbour: this round's seed only


@dataclass(frozen=True)
class RoundSum:
    job_id: str
    round: int
    ring_sum: np.ndarray
    senders: tuple[str, ...]


def new_job(
    job_id: str,
    parties: Sequence[str],
    dimension: int,
    *,
    min_senders: int | None = None,
    parameters: GraphParameters | None = None,
    scale_bits: int = DEFAULT_SCALE_BITS,
) -> JobConfig:
    """A validated job: graph and threshold from :func:`core.secagg.graph.choose_parameters`
    unless ``parameters`` are given; ``min_senders`` defaults to a strict majority."""
    names = tuple(parties)
    if not job_id:
        raise ConfigError("job_id must be a non-empty string")
    if len(names) < 2 or len(set(names)) != len(names) or not all(names):
        raise ConfigError(f"need at least 2 distinct, non-empty party names, got {list(names)}")
    params = parameters or choose_parameters(len(names))
    graph: NeighbourGraph = harary_graph(names, params.degree, graph_seed(job_id, names))
    k = graph.degree()
    if not (k + 1) // 2 < params.threshold <= k + 1:
        raise ConfigError(
            f"threshold {params.threshold} must be a majority of a party's {k + 1} holders"
        )
    floor = len(names) // 2 + 1
    minimum = floor if min_senders is None else min_senders
    if not floor <= minimum <= len(names):
        raise ConfigError(f"min_senders {minimum} must be in [{floor}, {len(names)}]")
    if dimension < 1 or not 0 <= scale_bits <= MAX_SCALE_BITS:
        raise ConfigError(f"need dimension >= 1 and scale_bits in [0, {MAX_SCALE_BITS}]")
    return JobConfig(
        job_id, names, dict(graph.neighbours), params.threshold, minimum, dimension, scale_bits
    )


# ---------------------------------------------------------------------------------------------
# Party


@dataclass(frozen=True)
class PeerSecrets:
    """What a party derived once per key epoch with one neighbour (never sent)."""

    keys: PeerKeys
    pair_secret: bytes  # seeds the pair masks of every round
    share_key: bytes  # AES-256-GCM key for the self-mask shares


@dataclass(frozen=True)
class MaskedRound:
    round: int
    senders_possible: tuple[str, ...]  # active neighbours it masked with
    own_share: int


@dataclass(frozen=True)
class JobPartyState:
    config: JobConfig
    party: str
    epoch: int
    private_key: bytes
    own_keys: PeerKeys
    peers: Mapping[str, PeerSecrets] = field(default_factory=dict)
    round: int = -1  # last round started
    active: tuple[str, ...] = ()
    masked: MaskedRound | None = None
    last_masked: int = -1
    answered: tuple[UnmaskRequest, UnmaskResponse] | None = None
    out: bool = False  # left out of a round: must re-key before contributing again
    viewed: UnmaskRequest | None = None  # the request whose view it signed (one a round)

    def public_keys(self) -> PeerKeys:
        return self.own_keys


def join(config: JobConfig, party: str) -> tuple[JobPartyState, KeyAdvertisement]:
    """Fresh key pairs (epoch 0); the public halves go to the coordinator once."""
    if party not in config.positions:
        raise ProtocolViolationError(f"party {party!r} is not a party of job {config.job_id}")
    return _fresh_keys(config, party, epoch=0, last_round=-1, last_masked=-1)


def rekey(state: JobPartyState) -> tuple[JobPartyState, KeyAdvertisement]:
    """Rejoin after being left out: new key pairs under a higher epoch; old secrets dropped."""
    return _fresh_keys(state.config, state.party, state.epoch + 1, state.round, state.last_masked)


def start_round(state: JobPartyState, start: RoundStart) -> JobPartyState:
    """Accept the round's active set and the neighbours' keys (agreeing new secrets once).

    A party not listed is out (it must re-key). A neighbour's keys may change only with a
    higher epoch, so a coordinator cannot swap keys under an epoch already agreed.
    """
    config, party = state.config, state.party
    where = f"party {party!r}: round {start.round} of job {config.job_id}"
    _require_job(config, start.job_id, where)
    if start.round <= state.round:
        raise ProtocolViolationError(
            f"{where}: rounds only go forward; already at round {state.round}"
        )
    listed = set(start.active)
    active = tuple(p for p in config.parties if p in listed)
    if len(active) != len(start.active):
        raise ProtocolViolationError(f"{where}: unknown or repeated parties in {start.active}")
    if party not in active:
        return replace(state, round=start.round, active=active, masked=None, out=True)
    if state.out:
        raise ProtocolViolationError(
            f"{where}: this party was left out of an earlier round and has not re-keyed; "
            "refusing to contribute under keys whose round seeds may be revealed"
        )
    if start.keys.get(party) != state.public_keys():
        raise ProtocolViolationError(f"{where}: the round does not carry this party's own keys")
    if len(active) < config.min_senders:
        raise InsufficientSurvivorsError(
            f"{where}: only {len(active)} active parties, fewer than {config.min_senders}"
        )
    new_keys = {}
    for peer in config.neighbours[party]:
        if peer not in active:
            continue
        offered = start.keys.get(peer)
        if offered is None:
            raise ProtocolViolationError(f"{where}: no keys for active neighbour {peer!r}")
        known = state.peers.get(peer)
        if known is not None and known.keys == offered:
            continue
        if known is not None and offered.epoch <= known.keys.epoch:
            raise ProtocolViolationError(
                f"{where}: neighbour {peer!r}'s keys changed without a new epoch "
                f"({known.keys.epoch} -> {offered.epoch})"
            )
        new_keys[peer] = offered
    peers = {**state.peers, **_agree(state, new_keys)}
    return replace(state, round=start.round, active=active, peers=peers, masked=None)


def mask_round(state: JobPartyState, values: np.ndarray) -> tuple[JobPartyState, MaskedInput]:
    """Fixed-point encode ``values`` and mask them for the started round."""
    ring = encode(
        values, len(state.config.parties), state.config.scale_bits, party=f"party {state.party!r}"
    )
    return mask_ring_round(state, ring)


def mask_ring_round(state: JobPartyState, ring: np.ndarray) -> tuple[JobPartyState, MaskedInput]:
    """y = x + PRG(b) + sum over active neighbours of +-PRG(round seed); b's shares to them.

    Persist the returned state before sending: a second call for the same round is refused.
    """
    config, party, r = state.config, state.party, state.round
    where = f"party {party!r}: round {r} of job {config.job_id}"
    if state.out or party not in state.active:
        raise ProtocolViolationError(f"{where}: this party is out of the session; re-key first")
    if r <= state.last_masked:
        raise ProtocolViolationError(
            f"{where}: already masked round {state.last_masked}; a round is masked once"
        )
    vector = np.asarray(ring)
    if vector.dtype != np.uint64 or vector.shape != (config.dimension,):
        raise ProtocolViolationError(
            f"{where}: input must be uint64 of length {config.dimension}, got {vector.dtype} "
            f"{vector.shape}"
        )
    active = set(state.active)
    partners = tuple(p for p in config.neighbours[party] if p in active)
    holders = (party, *partners)
    if len(holders) < config.threshold:
        raise InsufficientSurvivorsError(
            f"{where}: only {len(holders)} of this party's holders are active, fewer than "
            f"the threshold {config.threshold}; its self-mask could not be rebuilt"
        )
    seed = secrets.token_bytes(shamir.SECRET_BYTES)
    points = [config.positions[h] for h in holders]
    shares = shamir.split_secret(seed, points, config.threshold)
    encrypted = {peer: _seal(state, peer, r, shares[config.positions[peer]]) for peer in partners}
    masked = vector.copy()
    apply_mask(masked, seed, 1)
    for peer in partners:
        apply_mask(masked, _round_seed(state, peer, r), config.sign(party, peer))
    new_state = replace(
        state,
        masked=MaskedRound(r, partners, shares[config.positions[party]]),
        last_masked=r,
    )
    message = MaskedInput(
        config.job_id, r, party, state.epoch, masked, encrypted, _commit(config, r, party, seed)
    )
    return new_state, message


def view_quorum(config: JobConfig) -> int:
    """How many identical signed views a sender needs before it reveals anything: at least
    ``min_senders`` (a strict majority of all parties) and at least ``threshold``.

    Why a majority of *all* parties: two different views would then need two signer sets
    that overlap, and an honest party signs one view a round, so a coordinator without a
    colluding party cannot give two honest parties different stories (Bonawitz et al. 2017
    require t signatures; with their t > n/2 it is the same argument)."""
    return max(config.min_senders, config.threshold)


def sign_view(state: JobPartyState, request: UnmaskRequest) -> tuple[JobPartyState, SurvivorView]:
    """ConsistencyCheck, first half (Bonawitz et al. 2017, round 3): the survivor and dropped
    sets this party was told, to be signed by its channel and relayed to every sender.

    Reveals nothing. One view per round: a second, different request is refused here, before
    any signature could support two stories. Persist the returned state before sending.
    """
    config, party = state.config, state.party
    where = f"party {party!r}: unmask request for round {request.round} of job {config.job_id}"
    _require_job(config, request.job_id, where)
    for earlier in (state.viewed, state.answered[0] if state.answered else None):
        if earlier is not None and earlier.round == request.round and earlier != request:
            raise ProtocolViolationError(
                f"{where}: refused, the coordinator sent this party a different request for "
                "this round than the one it already signed; it would support two stories"
            )
    _check_request(state, request, where)
    view = SurvivorView(config.job_id, request.round, party, request.senders, request.dropped)
    return replace(state, viewed=request), view


def answer_unmask(
    state: JobPartyState, request: UnmaskRequest, views: Mapping[str, SurvivorView]
) -> tuple[JobPartyState, UnmaskResponse]:
    """ConsistencyCheck, second half, then Unmasking (Bonawitz et al. 2017, rounds 3 and 4):
    shares of the sending neighbours' self-masks and round seeds with the dropped ones, only
    once ``views`` (signer -> its view, each authenticated as its signer's by the caller)
    hold at least :func:`view_quorum` views identical to this party's.

    A view that differs, a signer the request calls dropped or too few signers is refused
    before anything is revealed, naming the coordinator. A party never reveals a seed with a
    neighbour that is a sender, and the agreed view lists it as a sender, so no honest party
    reveals a seed with it either. One request per round: an identical retry gets the same
    answer, a different one is refused.
    """
    config, party = state.config, state.party
    where = f"party {party!r}: unmask request for round {request.round} of job {config.job_id}"
    _require_job(config, request.job_id, where)
    if state.answered is not None and state.answered[0].round == request.round:
        if state.answered[0] == request:
            return state, state.answered[1]
        raise ProtocolViolationError(
            f"{where}: refused, this party already answered a different request for this "
            "round; answering again could reveal both secrets of one party"
        )
    if state.viewed != request:
        raise ProtocolViolationError(
            f"{where}: refused, this party has not signed its view of this request "
            "(sign_view): nothing is revealed before the consistency check"
        )
    _check_views(config, request, views, where)
    masked = state.masked
    assert masked is not None  # checked by sign_view
    partners = set(masked.senders_possible)
    sending = sorted(partners & set(request.senders))
    opened = {peer: _open(state, peer, request.round, request.shares[peer]) for peer in sending}
    gone = sorted(partners & set(request.dropped))
    response = UnmaskResponse(
        config.job_id,
        request.round,
        party,
        {party: masked.own_share, **opened},
        {peer: _round_seed(state, peer, request.round) for peer in gone},
    )
    return replace(state, answered=(request, response)), response


def _check_request(state: JobPartyState, request: UnmaskRequest, where: str) -> None:
    """What a request must be before this party signs a view of it (nothing is revealed)."""
    config, party, masked = state.config, state.party, state.masked
    if masked is None or masked.round != request.round:
        raise ProtocolViolationError(f"{where}: this party sent no masked input in that round")
    senders, dropped = set(request.senders), set(request.dropped)
    both = sorted(senders & dropped)
    if both:
        raise ProtocolViolationError(
            f"{where}: refused, {both} are listed both as senders and as dropped"
        )
    if party not in senders:
        raise ProtocolViolationError(f"{where}: refused, it lists this party as not sending")
    unknown = sorted((senders | dropped) - set(state.active))
    if unknown or len(senders) != len(request.senders) or len(dropped) != len(request.dropped):
        raise ProtocolViolationError(f"{where}: {unknown} were not active in the round")
    if len(senders) < config.min_senders:
        raise InsufficientSurvivorsError(
            f"{where}: only {len(senders)} senders, fewer than {config.min_senders}"
        )
    partners = set(masked.senders_possible)
    if not partners <= senders | dropped:
        raise ProtocolViolationError(
            f"{where}: neighbours {sorted(partners - senders - dropped)} are neither senders "
            "nor dropped"
        )
    sending = sorted(partners & senders)
    if sorted(request.shares) != sending:
        raise ProtocolViolationError(
            f"{where}: expected shares from exactly {sending}, got {sorted(request.shares)}"
        )


def _check_views(
    config: JobConfig, request: UnmaskRequest, views: Mapping[str, SurvivorView], where: str
) -> None:
    """At least :func:`view_quorum` signers, each a sender of this request, each told exactly
    this request's survivor and dropped sets; else the coordinator split the round."""
    for signer, view in views.items():
        if view.party != signer or view.job_id != config.job_id or view.round != request.round:
            raise ProtocolViolationError(
                f"{where}: refused before revealing anything, the coordinator relayed a view "
                f"of {view.party!r} (job {view.job_id!r}, round {view.round}) as {signer!r}'s"
            )
        if signer not in request.senders or (view.senders, view.dropped) != (
            request.senders,
            request.dropped,
        ):
            raise ProtocolViolationError(
                f"{where}: refused before revealing anything, the coordinator told {signer!r} "
                f"senders {list(view.senders)} and dropped {list(view.dropped)}, but this "
                f"party senders {list(request.senders)} and dropped {list(request.dropped)}: "
                "the coordinator split the round's survivor set"
            )
    if len(views) < view_quorum(config):
        raise ProtocolViolationError(
            f"{where}: refused before revealing anything, the coordinator relayed "
            f"{len(views)} signed views of the survivor set ({sorted(views)}), fewer than the "
            f"{view_quorum(config)} the job's terms need"
        )


# ---------------------------------------------------------------------------------------------
# Coordinator


@dataclass(frozen=True)
class JobCoordinatorState:
    config: JobConfig
    keys: Mapping[str, PeerKeys] = field(default_factory=dict)
    active: tuple[str, ...] = ()  # admitted and not left out since
    round: int = -1
    stage: str = "idle"  # idle -> collecting -> unmasking -> idle
    senders: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    commitments: Mapping[str, bytes] = field(default_factory=dict)
    masked_sum: np.ndarray | None = None


def start_coordinator(config: JobConfig) -> JobCoordinatorState:
    return JobCoordinatorState(config)


def admit(
    state: JobCoordinatorState, advertisements: Sequence[KeyAdvertisement]
) -> JobCoordinatorState:
    """Between rounds: take parties' keys (first ones, or a re-key with a higher epoch)."""
    config, where = state.config, "coordinator admit"
    _require_stage(state, "idle", where)
    known, active = dict(state.keys), set(state.active)
    for ad in advertisements:
        _require_job(config, ad.job_id, where)
        if ad.party not in config.positions:
            raise ProtocolViolationError(f"{where}: unknown party {ad.party!r}")
        if len(ad.keys.public) != 32:
            raise ProtocolViolationError(f"{where}: party {ad.party!r} sent malformed keys")
        before = known.get(ad.party)
        if before is not None and before != ad.keys and ad.keys.epoch <= before.epoch:
            raise ProtocolViolationError(
                f"{where}: party {ad.party!r} re-keyed without a higher epoch"
            )
        if before is not None and before == ad.keys and ad.party not in active:
            raise ProtocolViolationError(
                f"{where}: party {ad.party!r} was left out and must re-key to rejoin"
            )
        known[ad.party] = ad.keys
        active.add(ad.party)
    order = tuple(p for p in config.parties if p in active)
    return replace(state, keys=known, active=order)


def open_round(
    state: JobCoordinatorState, round_: int
) -> tuple[JobCoordinatorState, dict[str, RoundStart]]:
    """The round's start for every active party (its own keys and its active neighbours')."""
    config, where = state.config, f"coordinator round {round_}"
    _require_stage(state, "idle", where)
    if round_ <= state.round:
        raise ProtocolViolationError(f"{where}: rounds only go forward (last {state.round})")
    if len(state.active) < config.min_senders:
        raise InsufficientSurvivorsError(
            f"{where} of job {config.job_id}: only {list(state.active)} are in the session, "
            f"fewer than {config.min_senders}"
        )
    active = set(state.active)
    starts = {
        p: RoundStart(
            config.job_id,
            round_,
            state.active,
            {q: state.keys[q] for q in config.holders(p) if q in active},
        )
        for p in state.active
    }
    new_state = replace(
        state, round=round_, stage="collecting", senders=(), dropped=(), masked_sum=None
    )
    return new_state, starts


def collect_inputs(
    state: JobCoordinatorState, inputs: Sequence[MaskedInput]
) -> tuple[JobCoordinatorState, dict[str, UnmaskRequest]]:
    """Add the masked inputs; ask each sender for what unmasks the sum (and only that)."""
    config, r = state.config, state.round
    where = f"coordinator round {r} of job {config.job_id}, masked inputs"
    _require_stage(state, "collecting", where)
    active = set(state.active)
    by_party: dict[str, MaskedInput] = {}
    total = np.zeros(config.dimension, dtype=np.uint64)
    for message in inputs:
        sender = message.party
        _require_job(config, message.job_id, where)
        if message.round != r or sender not in active or sender in by_party:
            raise ProtocolViolationError(
                f"{where}: refused input of {sender!r} for round {message.round} (not active, "
                "repeated, or another round)"
            )
        if message.epoch != state.keys[sender].epoch:
            raise ProtocolViolationError(f"{where}: {sender!r} masked under stale keys")
        vector = np.asarray(message.masked)
        if vector.dtype != np.uint64 or vector.shape != (config.dimension,):
            raise ProtocolViolationError(f"{where}: {sender!r} sent {vector.dtype} {vector.shape}")
        partners = sorted(p for p in config.neighbours[sender] if p in active)
        if sorted(message.shares) != partners or len(message.commitment) != 32:
            raise ProtocolViolationError(
                f"{where}: {sender!r} must send shares to exactly {partners} and a commitment"
            )
        by_party[sender] = message
        np.add(total, vector, out=total)
    senders = tuple(p for p in state.active if p in by_party)
    dropped = tuple(p for p in state.active if p not in by_party)
    if len(senders) < config.min_senders:
        raise InsufficientSurvivorsError(
            f"{where}: only {list(senders)} sent, fewer than {config.min_senders}; missing "
            f"{list(dropped)}. Nothing was unmasked"
        )
    sent = set(senders)
    requests = {
        v: UnmaskRequest(
            config.job_id,
            r,
            senders,
            dropped,
            {u: by_party[u].shares[v] for u in config.neighbours[v] if u in sent},
        )
        for v in senders
    }
    new_state = replace(
        state,
        stage="unmasking",
        active=senders,  # the dropped are out until they re-key
        senders=senders,
        dropped=dropped,
        commitments={p: by_party[p].commitment for p in senders},
        masked_sum=total,
    )
    return new_state, requests


def collect_views(state: JobCoordinatorState, views: Sequence[SurvivorView]) -> tuple[str, ...]:
    """The senders whose signed views to relay (all of them, to every sender): each must be
    the view this coordinator gave, and at least :func:`view_quorum` must have come, or no
    sender would answer (the round fails here, naming who is missing)."""
    config, r = state.config, state.round
    where = f"coordinator round {r} of job {config.job_id}, survivor views"
    _require_stage(state, "unmasking", where)
    signed: set[str] = set()
    for view in views:
        _require_job(config, view.job_id, where)
        told = (state.senders, state.dropped)
        if view.round != r or view.party not in state.senders or view.party in signed:
            raise ProtocolViolationError(f"{where}: refused a view of {view.party!r}")
        if (view.senders, view.dropped) != told:
            raise ProtocolViolationError(
                f"{where}: {view.party!r} signed senders {list(view.senders)} and dropped "
                f"{list(view.dropped)}, not the sets it was sent"
            )
        signed.add(view.party)
    if len(signed) < view_quorum(config):
        missing = [p for p in state.senders if p not in signed]
        raise InsufficientSurvivorsError(
            f"{where}: only {len(signed)} senders signed their view, fewer than "
            f"{view_quorum(config)}; missing {missing}. Nothing was unmasked"
        )
    return tuple(p for p in state.senders if p in signed)


def unmask(
    state: JobCoordinatorState, responses: Sequence[UnmaskResponse]
) -> tuple[JobCoordinatorState, RoundSum]:
    """Rebuild each sender's self-mask, remove the dropped parties' pair masks: the sum."""
    config, r = state.config, state.round
    where = f"coordinator round {r} of job {config.job_id}, unmasking"
    _require_stage(state, "unmasking", where)
    sent, gone = set(state.senders), set(state.dropped)
    by_party: dict[str, UnmaskResponse] = {}
    for response in responses:
        v = response.party
        _require_job(config, response.job_id, where)
        if response.round != r or v not in sent or v in by_party:
            raise ProtocolViolationError(f"{where}: refused response of {v!r}")
        own = {v} | (set(config.neighbours[v]) & sent)
        if set(response.self_mask_shares) != own or set(response.pair_seeds) != (
            set(config.neighbours[v]) & gone
        ):
            raise ProtocolViolationError(
                f"{where}: {v!r} must send self-mask shares for {sorted(own)} and round seeds "
                f"for {sorted(set(config.neighbours[v]) & gone)} only"
            )
        by_party[v] = response
    assert state.masked_sum is not None  # set when entering "unmasking"
    total = state.masked_sum.copy()
    for u in state.senders:
        answered = [h for h in config.holders(u) if h in by_party]
        if len(answered) < config.threshold:
            raise InsufficientSurvivorsError(
                f"{where}: only {len(answered)} of {u!r}'s share holders answered, fewer than "
                f"{config.threshold}; the round is aborted"
            )
        shares = {config.positions[h]: by_party[h].self_mask_shares[u] for h in answered}
        seed = shamir.reconstruct_secret(shares, config.threshold)
        if _commit(config, r, u, seed) != state.commitments[u]:
            raise ProtocolViolationError(
                f"{where}: shares of {u!r}'s self-mask do not match its commitment"
            )
        apply_mask(total, seed, -1)
    for u in state.dropped:
        for v in config.neighbours[u]:
            if v not in sent:
                continue
            if v not in by_party:
                raise InsufficientSurvivorsError(
                    f"{where}: {v!r} sent its input masked against dropped {u!r} but did not "
                    "answer, so their round seed is lost; the round is aborted"
                )
            # v applied sign(v, u) * mask; undo exactly that
            apply_mask(total, by_party[v].pair_seeds[u], -config.sign(v, u))
    answered_all = tuple(p for p in state.senders if p in by_party)
    new_state = replace(state, stage="idle", active=answered_all, masked_sum=None)
    return new_state, RoundSum(config.job_id, r, total, state.senders)


# ---------------------------------------------------------------------------------------------
# Helpers (secrets never leave these)


def _fresh_keys(
    config: JobConfig, party: str, epoch: int, last_round: int, last_masked: int
) -> tuple[JobPartyState, KeyAdvertisement]:
    private, public = keys.new_key_pair()
    state = JobPartyState(
        config,
        party,
        epoch,
        private,
        PeerKeys(epoch, public),
        round=last_round,
        last_masked=last_masked,
    )
    return state, KeyAdvertisement(config.job_id, party, state.public_keys())


def _agree(state: JobPartyState, offered: Mapping[str, PeerKeys]) -> dict[str, PeerSecrets]:
    """Pair secret and share key with each peer for the two parties' current epochs.

    One X25519 key pair per epoch is enough (the single-session protocol needs two because it
    Shamir-shares the mask key): no per-job secret is ever shared or rebuilt, so both keys
    are HKDF outputs of one agreement under different labels.
    """
    config, party = state.config, state.party
    shared = keys.agree_with_peers(
        state.private_key, {peer: k.public for peer, k in offered.items()}
    )
    secrets_by_peer = {}
    for peer, peer_keys in offered.items():
        first, second = sorted((party, peer), key=config.positions.__getitem__)
        epochs = {party: state.epoch, peer: peer_keys.epoch}
        context = (config.job_id, first, second, str(epochs[first]), str(epochs[second]))
        secrets_by_peer[peer] = PeerSecrets(
            peer_keys,
            _hkdf(shared[peer], "pair-secret", *context),
            _hkdf(shared[peer], "share-key", *context),
        )
    return secrets_by_peer


def _round_seed(state: JobPartyState, peer: str, round_: int) -> bytes:
    """This round's pair seed with ``peer``: a PRF of the never-revealed pair secret."""
    secret = state.peers[peer].pair_secret
    return hmac.new(secret, _context("round-seed", str(round_)), hashlib.sha256).digest()


def _seal(state: JobPartyState, peer: str, round_: int, share: int) -> bytes:
    header = _context("share", state.config.job_id, str(round_), state.party, peer)
    nonce = os.urandom(_NONCE_BYTES)
    body = AESGCM(state.peers[peer].share_key).encrypt(nonce, shamir.share_to_bytes(share), header)
    return nonce + body


def _open(state: JobPartyState, sender: str, round_: int, ciphertext: bytes) -> int:
    header = _context("share", state.config.job_id, str(round_), sender, state.party)
    try:
        plain = AESGCM(state.peers[sender].share_key).decrypt(
            ciphertext[:_NONCE_BYTES], ciphertext[_NONCE_BYTES:], header
        )
    except (InvalidTag, ValueError) as error:
        raise ProtocolViolationError(
            f"party {state.party!r}: the share from {sender!r} for round {round_} failed "
            "authentication (tampered, re-routed or from another round)"
        ) from error
    return shamir.share_from_bytes(plain)


def _commit(config: JobConfig, round_: int, party: str, seed: bytes) -> bytes:
    return hashlib.sha256(_context("self-mask", config.job_id, str(round_), party) + seed).digest()


def _hkdf(secret: bytes, purpose: str, *fields: str) -> bytes:
    info = _context(purpose, *fields)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _context(*fields: str) -> bytes:
    """Unambiguous (length-prefixed) encoding of the protocol label and ``fields``."""
    out = [_LABEL_PREFIX]
    for text in fields:
        data = text.encode()
        out.append(len(data).to_bytes(4, "big") + data)
    return b"".join(out)


def _require_job(config: JobConfig, job_id: str, where: str) -> None:
    if job_id != config.job_id:
        raise ProtocolViolationError(f"{where}: message of job {job_id!r}, not {config.job_id!r}")


def _require_stage(state: JobCoordinatorState, expected: str, where: str) -> None:
    if state.stage != expected:
        raise ProtocolViolationError(f"{where}: needs stage {expected!r}, at {state.stage!r}")
