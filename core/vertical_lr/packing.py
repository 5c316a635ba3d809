"""The gradient's return trip, packed: several masked entries in one Paillier plaintext.

After BatchCrypt (C. Zhang, S. Li, J. Xia, W. Wang, F. Yan, Y. Liu, "BatchCrypt: Efficient
Homomorphic Encryption for Cross-Silo Federated Learning", USENIX ATC 2020), which packs
quantised gradients into one plaintext with room left in each slot so sums cannot carry
into the next. Here the packing is homomorphic, after ``X^T [[d]]``: a party folds ``m``
encrypted entries into ``[[sum_j v_j 2^(s j)]]`` (shift by squaring, add by multiplying),
each slot holding ``v_j = g_j + 2^B + r_j``, so the key holder decrypts, and sends back, one
value for ``m`` entries.

The margin, from public facts only (so the key holder knows the packed length too):

* a feature is ``round(x 2^20)`` with ``|x| <= 2^30`` (``encode_features`` refuses more), so
  ``|x_int| <= 2^50``;
* each residual term is ``round(v 2^24)`` with ``|v| <= 2^16`` (``encode_residual`` refuses
  more), and ``d`` adds one term per host and the guest's, so ``|d| <= (hosts + 1) 2^40``;
* so ``|g_j| = |sum_rows x_int d| <= batch (hosts + 1) 2^90 < 2^B``;
* a mask ``r_j`` uniform below ``2^(B + 81)`` hides ``g_j + 2^B`` (at most ``2^(B+1)``) to
  within ``2^-80`` statistical distance, as the unpacked path's 256-bit masks do;
* so ``0 < v_j < 2^(B + 82)``: a slot of ``s = B + 82`` bits never carries, and ``m`` slots
  with ``m s <= bits(n) - 2`` keep the packed value below ``n / 2``, which decryption returns
  unchanged (above ``n / 2`` it would read as negative).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from core.vertical_lr.fixed_point import MAX_FEATURE_INT, MAX_RESIDUAL_INT

STATISTICAL_BITS = 80  # the masks' hiding, as core.paillier.cipher.random_masks
MIN_SLOTS = 4  # fewer (keys below about 1024 bits, tests only) keep the unpacked message


class PackingOverflowError(ValueError):
    """A packed value or slot is outside the margin the layout was derived for."""


@dataclass(frozen=True)
class Layout:
    """Where each masked entry sits in a packed plaintext."""

    gradient_bits: int  # B: every |g_j| < 2^B
    slot_bits: int  # s = B + STATISTICAL_BITS + 2
    slots: int  # m entries per plaintext

    def packed_length(self, width: int) -> int:
        return -(-width // self.slots)

    def masks(self, width: int) -> list[int]:
        """Fresh ``r_j``, uniform below ``2^(B + 81)``; they stay with the party."""
        return [secrets.randbits(self.gradient_bits + STATISTICAL_BITS + 1) for _ in range(width)]

    def packed_masks(self, masks: Sequence[int]) -> list[int]:
        """Per plaintext, ``sum_j (2^B + r_j) 2^(s j)``: added to the packed gradient."""
        offset = 1 << self.gradient_bits
        return [
            sum((offset + r) << (self.slot_bits * j) for j, r in enumerate(group))
            for group in self.groups(masks)
        ]

    def groups(self, values: Sequence[int]) -> list[list[int]]:
        return [list(values[a : a + self.slots]) for a in range(0, len(values), self.slots)]

    def unpack(self, packed: Sequence[int], masks: Sequence[int]) -> list[int]:
        """The gradient entries from the decrypted packed values and the party's masks;
        raises if any value or slot is outside the margin (an input beyond the bounds)."""
        if len(packed) != self.packed_length(len(masks)):
            raise PackingOverflowError(
                f"{len(packed)} packed values for {len(masks)} entries of {self.slots} slots"
            )
        full, offset = (1 << self.slot_bits) - 1, 1 << self.gradient_bits
        out = []
        for value, group in zip(packed, self.groups(masks), strict=True):
            if not 0 <= value < 1 << (self.slot_bits * len(group)):
                raise PackingOverflowError("a packed gradient is outside its slots' range")
            for j, r in enumerate(group):
                g = ((value >> (self.slot_bits * j)) & full) - offset - r
                if abs(g) >= offset:
                    raise PackingOverflowError(f"gradient entry beyond 2^{self.gradient_bits}")
                out.append(g)
        return out


def gradient_bound(batch_rows: int, hosts: int) -> int:
    """The largest ``|X^T d|`` entry the fixed-point bounds allow for a batch."""
    return batch_rows * MAX_FEATURE_INT * (hosts + 1) * MAX_RESIDUAL_INT


def layout(key_bits: int, batch_rows: int, hosts: int) -> Layout | None:
    """The packing for a key and a job's batch size and host count, or None where fewer
    than ``MIN_SLOTS`` entries fit one plaintext."""
    bits = gradient_bound(batch_rows, hosts).bit_length()
    slot = bits + STATISTICAL_BITS + 2
    slots = (key_bits - 2) // slot
    if slots < MIN_SLOTS:
        return None
    assert slots * slot <= key_bits - 2  # packed values stay below n / 2 (module docstring)
    return Layout(bits, slot, slots)
