"""Secure aggregation with dropout recovery (Bonawitz et al., CCS 2017, "double masking").

A coordinator learns the sum of the parties' vectors and nothing else, and the round still
finishes when up to ``n - threshold`` parties drop. Messages per session:

====================  ======================================  ==============================
step (sender)          message                                 to
====================  ======================================  ==============================
advertise_keys (P)     KeyAdvertisement: 2 X25519 public keys  coordinator
collect_key_adv. (C)   KeyDirectory                            every advertiser
share_keys (P)         ShareKeysMessage: AEAD-encrypted        coordinator
                       Shamir shares per recipient
route_encrypted (C)    ShareDelivery: ciphertexts for you      each share sender
mask_input (P)         MaskedInputMessage: y = x + masks       coordinator
collect_masked (C)     UnmaskRequest: senders / dropped        every input sender
reveal_shares (P)      UnmaskResponse: seed or key shares      coordinator
reconstruct_sum (C)    RingAggregate: exact sum                (result)
====================  ======================================  ==============================

:func:`secure_sum` runs all of it in one process.

Security notes: each honest party answers one unmask request per session and refuses to
reveal both shares for one party, so with ``threshold > n / 2`` the coordinator alone (or
with fewer than ``2 * threshold - n`` colluding parties) cannot unmask anyone who sent.
Public keys are not signed here: the transport must authenticate who sent each message.
Use a fresh ``session_id`` for every round.

Many rounds of one job: :mod:`core.secagg.multiround` agrees keys once per job and derives
each round's masks from them (two message exchanges a round instead of four), over the sparse
SecAgg+ neighbour graph of :mod:`core.secagg.graph` (O(log n) neighbours per party);
:mod:`core.secagg.simulation` runs it for many parties in one process.
"""

from core.secagg.coordinator import (
    CoordinatorState,
    collect_key_advertisements,
    collect_masked_inputs,
    reconstruct_sum,
    route_encrypted_shares,
    start_coordinator,
)
from core.secagg.driver import (
    DROPOUT_STAGES,
    RingSumResult,
    SecureSumResult,
    SecureWeightedMean,
    secure_ring_sum,
    secure_sum,
    secure_weighted_mean,
)
from core.secagg.errors import (
    ConfigError,
    FixedPointError,
    InsufficientSurvivorsError,
    ProtocolViolationError,
    SecAggError,
)
from core.secagg.fixed_point import DEFAULT_SCALE_BITS, decode, encode, max_abs_value
from core.secagg.party import (
    PartyState,
    advertise_keys,
    mask_input,
    mask_ring_input,
    reveal_shares,
    share_keys,
)
from core.secagg.session import SessionConfig, default_threshold, new_session
from core.secagg.weighted import WeightedAggregate, pack_weighted, unpack_weighted

__all__ = [
    "DEFAULT_SCALE_BITS",
    "DROPOUT_STAGES",
    "ConfigError",
    "CoordinatorState",
    "FixedPointError",
    "InsufficientSurvivorsError",
    "PartyState",
    "ProtocolViolationError",
    "RingSumResult",
    "SecAggError",
    "SecureSumResult",
    "SecureWeightedMean",
    "SessionConfig",
    "WeightedAggregate",
    "advertise_keys",
    "collect_key_advertisements",
    "collect_masked_inputs",
    "decode",
    "default_threshold",
    "encode",
    "mask_input",
    "mask_ring_input",
    "max_abs_value",
    "new_session",
    "pack_weighted",
    "reconstruct_sum",
    "reveal_shares",
    "route_encrypted_shares",
    "secure_ring_sum",
    "secure_sum",
    "secure_weighted_mean",
    "share_keys",
    "start_coordinator",
    "unpack_weighted",
]
