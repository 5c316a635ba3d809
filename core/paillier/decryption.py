"""Paillier decryption with the Chinese remainder theorem, on gmpy2 integers.

Decrypting modulo p^2 and q^2 separately and recombining is the standard speed-up from
Paillier's paper (EUROCRYPT 1999, Section 7): two half-size exponentiations instead of one
exponentiation with a full-size exponent modulo n^2. Results equal ``phe``'s ``raw_decrypt``.
"""

from __future__ import annotations

from collections.abc import Sequence

import gmpy2
from gmpy2 import mpz

from core.paillier import native
from core.paillier.errors import PaillierError


def check_ciphertexts(ciphertexts: Sequence[int | mpz], n: int | mpz) -> None:
    """Refuse anything that is not a ciphertext: an integer outside (0, n^2), or a non-unit.

    A value sharing a factor with ``n`` is never an honest encryption, and "decrypting" it
    leaks the key: ``c = n`` comes out under CRT as ``(p + q)^-1 mod n``, which factors ``n``.
    One gcd per value costs little beside the exponentiations of decryption.
    """
    n = mpz(n)
    n_square = n * n
    for position, ciphertext in enumerate(ciphertexts):
        if isinstance(ciphertext, bool) or not isinstance(ciphertext, int | type(n)):
            raise PaillierError(f"ciphertext at position {position} is not an integer")
        if not 0 < ciphertext < n_square:
            raise PaillierError(f"ciphertext at position {position} is not in (0, n^2)")
        if gmpy2.gcd(mpz(ciphertext), n) != 1:
            raise PaillierError(
                f"ciphertext at position {position} is not a unit modulo n^2 (it shares a "
                "factor with n): refused, decrypting it would reveal the key"
            )


class CrtDecryptor:
    """Precomputed CRT constants for one private key (p, q)."""

    __slots__ = ("_hp", "_hq", "_n", "_p", "_p_inverse", "_p_square", "_q", "_q_square")

    def __init__(self, p: int, q: int) -> None:
        self._p, self._q = mpz(p), mpz(q)
        self._n = self._p * self._q
        self._p_square, self._q_square = self._p * self._p, self._q * self._q
        self._p_inverse = gmpy2.invert(self._p, self._q)
        # With g = n + 1, g^(p-1) = 1 + (p-1) n (mod p^2), so L_p(g^(p-1)) = -q (mod p) and
        # the usual constant h_p = L_p(g^(p-1))^-1 needs no exponentiation (same for q).
        self._hp = gmpy2.invert(-self._q % self._p, self._p)
        self._hq = gmpy2.invert(-self._p % self._q, self._q)

    @classmethod
    def from_private_key(cls, private_key: object) -> CrtDecryptor:
        """Build from a ``phe`` private key (anything with integer ``p`` and ``q``)."""
        return cls(int(private_key.p), int(private_key.q))  # type: ignore[attr-defined]

    def decrypt_many(self, ciphertexts: Sequence[int | mpz]) -> list[mpz]:
        """Raw plaintexts in [0, n) for a batch of ciphertexts (refuses non-ciphertexts)."""
        check_ciphertexts(ciphertexts, self._n)
        mod_p = [mpz(c) % self._p_square for c in ciphertexts]
        mod_q = [mpz(c) % self._q_square for c in ciphertexts]
        lifted_p = native.fixed_exponent_powers(mod_p, self._p - 1, self._p_square)
        lifted_q = native.fixed_exponent_powers(mod_q, self._q - 1, self._q_square)
        return [self._combine(a, b) for a, b in zip(lifted_p, lifted_q, strict=True)]

    def _combine(self, lifted_p: mpz, lifted_q: mpz) -> mpz:
        m_p = ((lifted_p - 1) // self._p) * self._hp % self._p
        m_q = ((lifted_q - 1) // self._q) * self._hq % self._q
        return m_p + ((m_q - m_p) * self._p_inverse % self._q) * self._p
