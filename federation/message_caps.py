"""How large a message of each kind may be, checked by the receiver before it writes a byte.

A peer announces a message's size before streaming it. Kinds whose size follows the feature
count or a few values (gradients, losses, keys, terms) have caps far below the codec's
2 GiB, so a peer cannot make a receiver write (or later decode) gigabytes under a kind that
never needs them; kinds with a row per record (encrypted residuals, blinded ids, scores)
take the default, which ``[limits] message_bytes`` in ``party.toml`` sets (it is never above
``PRIVREG_MAX_MESSAGE_BYTES``) and ``[limits.kinds]`` overrides one kind.

The caps assume at most 65,536 features and 4096-bit Paillier keys (a ciphertext mod n^2
is 1 KiB): a vector of d ciphertexts is d KiB, 64 MiB at the bound. Secure aggregation
carries second moments in sparse LDA (d^2 values) and so gets more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from storage import codec

KiB, MiB = 1 << 10, 1 << 20
_CONTROL = 1 * MiB  # a few values: set-up facts, terms, keys, digests, one loss term
_VECTOR = 64 * MiB  # one value per feature, possibly encrypted

#: Caps by kind; a name ending in "_" covers every kind starting with it. Kinds of one
#: attempt (``secagg_keys.<session>``) are looked up without their suffix.
KIND_CAPS: dict[str, int] = {
    # set-up and control
    "setup": _CONTROL,
    "features": _CONTROL,
    "schema": _CONTROL,
    "schema_agreed": _CONTROL,
    "id_order_digest": _CONTROL,
    "label_dp_terms": _CONTROL,
    "walr_features": _CONTROL,
    "walr_plan": _CONTROL,
    "walr_public_key": _CONTROL,
    "public_key": _CONTROL,
    "sum_call": _CONTROL,
    "round": _CONTROL,
    "stop": _CONTROL,
    "holdout_score": _CONTROL,
    "score_model": _CONTROL,  # vertical scoring: the training job, the standing alignment
    "score_alignment": _CONTROL,
    "score_alignment_same": _CONTROL,
    "square_": _CONTROL,
    "cross_": _CONTROL,
    "loss_": _CONTROL,
    "secagg_directory": 16 * MiB,
    "secagg_keys": 16 * MiB,
    "secagg_shares": 16 * MiB,
    "secagg_commitment": _CONTROL,  # a peer's copy of one self-mask commitment
    "secagg_unmask_request": 16 * MiB,
    "secagg_unmask_response": 16 * MiB,
    # multi-round secure aggregation (tasks/secure_rounds.py): one X25519 key a party, once
    # per job or per re-key; the call ("round") lists the active parties' keys
    "secagg_job_keys": _CONTROL,
    "rejoin": _CONTROL,
    # the coordinator's relay of every sender's masked input or answer, with its proof
    "secagg_masked_relay": 512 * MiB,
    "secagg_unmask_response_relay": 512 * MiB,
    # the consistency round: a sender's view of the survivor set, and the relay of all views
    "secagg_view": 16 * MiB,
    "secagg_view_relay": 64 * MiB,
    # one value per feature
    "masked_gradient": _VECTOR,
    "model": _VECTOR,
    "weights": _VECTOR,
    "walr_masked_sums": _VECTOR,
    "walr_release": _VECTOR,
    "secagg_masked": 512 * MiB,  # sparse LDA's second moments: d^2 values
}


@dataclass(frozen=True)
class MessageCaps:
    """The receiver's cap per kind: the table, this party's overrides, and the default."""

    default: int = codec.MESSAGE.max_bytes
    kinds: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, cap in {"message_bytes": self.default, **self.kinds}.items():
            if not isinstance(cap, int) or cap <= 0:
                raise ValueError(f"limits: the cap for {kind!r} must be a positive integer")

    def cap(self, kind: str) -> tuple[int, str]:
        """The cap for ``kind`` and where it comes from (for the refusal's message)."""
        base = kind.split(".", 1)[0]
        ceiling = codec.MESSAGE.max_bytes
        for table, where in ((self.kinds, "limits.kinds"), (KIND_CAPS, "the kind table")):
            rule = base if base in table else _prefix(base, table)
            if rule is not None:
                return min(table[rule], ceiling), f"{where}[{rule!r}]"
        return min(self.default, ceiling), "limits.message_bytes"


def _prefix(kind: str, table: dict[str, int]) -> str | None:
    matches = [rule for rule in table if rule.endswith("_") and kind.startswith(rule)]
    return max(matches, key=len) if matches else None
