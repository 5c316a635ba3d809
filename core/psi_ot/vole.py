"""Silent random VOLE over GF(2^128), semi-honest: ``C = B + A * Delta`` at ``m`` positions,
the receiver holding ``A`` and ``C``, the sender ``Delta`` and ``B``, for a communication that
grows with ``t log(m)``, not with ``m``.

The pseudorandom correlation generator from LPN of Boyle, Couteau, Gilboa, Ishai, Kohl and
Scholl ("Efficient Pseudorandom Correlation Generators: Silent OT Extension and More", CCS
2019), in its dual-LPN form:

1. *Correlated OT with the sender's Delta* (:func:`receiver_extend`, :func:`sender_extend`):
   IKNP-style OT extension whose 128 base OTs (:mod:`.base_ot`, roles reversed) the sender
   chooses with the bits of ``Delta``; the receiver picks its own choice bits ``r``, sends the
   128 columns ``u``, and row by row ``t_j = q_j + r_j Delta`` (receiver ``t``, sender ``q``).
2. *Base VOLE* for the noise values: 128 such rows per value, packed as
   ``sum_k x^k t_k = sum_k x^k q_k + beta Delta`` with ``beta`` the 128 choice bits
   (:func:`.gf128.pack_bits`).
3. *Sparse VOLE* (regular noise, ``t`` blocks of ``L = 2^d`` positions): in block ``i`` the
   sender expands a GGM tree (fixed-key AES as the length-doubling PRG) to leaves ``v``; for
   each level it sends the XOR of all left and of all right children, each encrypted under one
   random OT (a correlated OT through a tweakable correlation-robust hash,
   ``pi(pi(x) + j) + pi(x)``, Guo, Katz, Wang and Yu, "Efficient and Secure Multiparty
   Computation from Fixed-Key Block Ciphers", S&P 2020); the receiver, choosing the side off
   its secret path to ``alpha_i``, learns every leaf but ``v_alpha``. With
   ``gamma_i = sum_j v_j + b'_i`` it sets its leaf ``alpha_i`` to ``v_alpha + beta_i Delta``.
4. *Compression* by the transpose of an expand-accumulate code (Boyle, Couteau, Gilboa, Ishai,
   Kohl, Resch, Scholl, "Correlated Pseudorandomness from Expand-Accumulate Codes", CRYPTO
   2022): prefix-XOR the ``N = t L >= 5 m`` positions, then output ``j`` is the XOR of
   ``W = 41`` positions drawn from a public code key (:func:`compress`; a 32-bit draw scaled
   to ``[0, N)``, whose bias, below ``N / 2^32``, only skews a public code). Linear, so the
   sparse correlation becomes ``C = B + A Delta`` with ``A`` the compressed noise,
   pseudorandom under dual LPN for that code.

Parameters, as libOTe configures its expand-accumulate code "ExAcc40" for silent VOLE: rate
1/5 (``N >= 5 m``), expander weight 41, an estimated relative minimum distance ``delta = 0.2``.
A linear test against dual LPN with regular noise has bias about ``(1 - 2 delta)^t`` (the
bound libOTe sizes its noise by), so :data:`NOISE` is the least ``t``, rounded up to a
multiple of 8, that puts it below 2^-128: 176 trees. A rate-1/2 code would be cheaper, but we
know of no published distance estimate for EA codes at that rate to size its noise by.

What each party learns: the receiver sees the sender's level sums encrypted under OTs it
cannot open on its path, and ``gamma`` masked by the leaf it lacks: nothing about ``Delta`` or
``B``. The sender sees ``u``, the receiver's choice bits masked by a PRG of base-OT seeds it
holds only one of: nothing about ``alpha``, ``beta`` or ``A``. Randomness comes from one
16-byte seed per party and bucket (:mod:`.primitives`), so a retried step recomputes its
message. Communication (:func:`message_bytes`): ``16 (128 t + t d)`` bytes of ``u`` and
``32 t d + 16 t`` of level sums and ``gamma``, about 0.46 MB at ``m = 2^17``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.psi_ot import gf128, native
from core.psi_ot.bitmatrix import transpose
from core.psi_ot.primitives import aes_blocks, prg, prg_array

WIDTH = 128  # base OTs: one per bit of Delta
SECURITY = 128  # bits: the linear-test bias the noise weight is sized for
RATE_INVERSE = 5  # N >= 5 m
MIN_DISTANCE = 0.2  # the code's estimated relative minimum distance at that rate
EXPANDER = 41  # W, positions XORed per output of the code
NOISE = 8 * math.ceil(SECURITY / -math.log2(1 - 2 * MIN_DISTANCE) / 8)  # t: 176 GGM trees
_LEFT, _RIGHT = b"privreg-ggm-left", b"privreg-ggm-rght"
_PI = b"privreg-tccr-pi!"
_ALPHAS, _BETAS, _TREES, _CODE = 1, 2, 3, 4  # streams of a per-bucket seed


@dataclass(frozen=True)
class Shape:
    """Sizes of one VOLE of ``m`` positions: ``t`` trees of depth ``d``."""

    m: int
    depth: int
    noise: int = NOISE

    @property
    def leaves(self) -> int:
        return 1 << self.depth

    @property
    def length(self) -> int:
        """``N``: positions of the sparse VOLE."""
        return self.noise * self.leaves

    @property
    def cots(self) -> int:
        """Correlated OTs used: 128 per noise value, one per tree level."""
        return WIDTH * self.noise + self.noise * self.depth

    @property
    def padded(self) -> int:
        return -(-self.cots // 8) * 8


def shape(m: int) -> Shape:
    """The smallest depth with ``N = t 2^d >= 5 m`` (at least one level)."""
    return Shape(m, max(1, math.ceil(math.log2(max(RATE_INVERSE * m, 1) / NOISE))))


def message_bytes(s: Shape) -> int:
    """Bytes on the wire for one VOLE (both directions), from the message shapes."""
    return WIDTH * s.padded // 8 + 16 + 32 * s.noise * s.depth + 16 * s.noise


# ---- correlated OT with Delta (IKNP, base OTs chosen by Delta's bits) ----------------------


def delta_bits(delta: bytes) -> list[int]:
    """The sender's base-OT choices: bit ``j`` of ``Delta``."""
    return np.unpackbits(np.frombuffer(delta, np.uint8), bitorder="little").tolist()


def _choice_bits(seed: bytes, s: Shape) -> tuple[np.ndarray, np.ndarray]:
    """``(alphas, r)``: the receiver's noise positions and its COT choice bits (128 random
    bits per noise value, then per tree and level the side off the path to ``alpha``)."""
    alphas = (prg_array(seed, (s.noise, 4), _ALPHAS).view("<u4").ravel() % s.leaves).astype(
        np.int64
    )
    betas = prg_array(seed, (s.noise * WIDTH,), _BETAS) & 1
    levels = np.arange(s.depth - 1, -1, -1)
    path = (alphas[:, None] >> levels[None, :]) & 1  # (t, d): bit of level 1 first
    r = np.zeros(s.padded, dtype=np.uint8)
    r[: s.noise * WIDTH] = betas
    r[s.noise * WIDTH : s.cots] = (1 - path).ravel()
    return alphas, r


@dataclass(frozen=True)
class ReceiverCots:
    """The receiver's side of one extension: noise positions, choice bits, rows ``t``."""

    alphas: np.ndarray
    r: np.ndarray
    t: np.ndarray  # (cots, 2) uint64


def receiver_extend(
    seed: bytes, pairs: Sequence[tuple[bytes, bytes]], s: Shape, stream: int
) -> tuple[np.ndarray, ReceiverCots]:
    """Step 1 (receiver): the columns ``u`` (``(128, padded / 8)`` uint8) to send, and what it
    keeps. ``stream`` picks a fresh stretch of the base OTs' PRG (one per bucket)."""
    if len(pairs) != WIDTH:
        raise ValueError(f"the extension needs {WIDTH} base-OT seed pairs")
    alphas, r = _choice_bits(seed, s)
    bits = np.packbits(r, bitorder="little")
    u = np.empty((WIDTH, s.padded // 8), dtype=np.uint8)
    t_columns = np.empty_like(u)
    for j, (k0, k1) in enumerate(pairs):
        t_columns[j] = prg_array(k0, (s.padded // 8,), stream)
        u[j] = t_columns[j] ^ prg_array(k1, (s.padded // 8,), stream) ^ bits
    rows = gf128.to_words(transpose(t_columns))[: s.cots]
    return u, ReceiverCots(alphas, r[: s.cots], rows)


def sender_extend(
    chosen: Sequence[bytes], delta: bytes, u: np.ndarray, s: Shape, stream: int
) -> np.ndarray:
    """Step 1 (sender): rows ``q_j = t_j + r_j Delta``, ``(cots, 2)`` uint64."""
    if u.shape != (WIDTH, s.padded // 8):
        raise ValueError(f"u has shape {u.shape}, expected {(WIDTH, s.padded // 8)}")
    q_columns = np.empty_like(u)
    for j, (seed, bit) in enumerate(zip(chosen, delta_bits(delta), strict=True)):
        q_columns[j] = prg_array(seed, (s.padded // 8,), stream)
        if bit:
            q_columns[j] ^= u[j]
    return gf128.to_words(transpose(q_columns))[: s.cots]


# ---- GGM trees ------------------------------------------------------------------------------


def _children(nodes: np.ndarray) -> np.ndarray:
    """Both children of each node, ``(t, n, 16)`` to ``(t, 2 n, 16)``: ``AES_k(s) + s``."""
    flat = nodes.reshape(-1, 16)
    pair = np.stack([aes_blocks(_LEFT, flat) ^ flat, aes_blocks(_RIGHT, flat) ^ flat], axis=1)
    return pair.reshape(nodes.shape[0], 2 * nodes.shape[1], 16)


def _tccr(rows: np.ndarray, first: int, stream: int) -> np.ndarray:
    """``pi(pi(x) + tweak) + pi(x)`` per row, tweak ``(stream, first + i)``: ``(n, 16)``."""
    blocks = np.ascontiguousarray(rows).view(np.uint8).reshape(-1, 16)
    once = aes_blocks(_PI, blocks)
    tweaks = np.zeros((len(blocks), 2), dtype=np.uint64)
    tweaks[:, 0] = np.arange(first, first + len(blocks), dtype=np.uint64)
    tweaks[:, 1] = np.uint64(stream)
    return aes_blocks(_PI, once ^ tweaks.view(np.uint8)) ^ once


def _delta_words(delta: bytes) -> np.ndarray:
    return gf128.to_words(np.frombuffer(delta, np.uint8).reshape(1, 16))


@dataclass(frozen=True)
class SenderVole:
    """The sender's message of step 2 and its share ``B`` of the correlation."""

    message: dict[str, np.ndarray]
    b: np.ndarray  # (m, 2) uint64


def sender_vole(
    seed: bytes, delta: bytes, q: np.ndarray, s: Shape, code_key: bytes, stream: int
) -> SenderVole:
    """Step 2 (sender): the GGM level sums under the OTs, ``gamma``, and ``B``."""
    base = WIDTH * s.noise
    b_base = gf128.pack_bits(q[:base].reshape(s.noise, WIDTH, 2))
    nodes = prg_array(seed, (s.noise, 1, 16), _TREES)
    levels = np.empty((s.noise, s.depth, 2, 16), dtype=np.uint8)
    for level in range(s.depth):
        nodes = _children(nodes)
        levels[:, level, 0] = np.bitwise_xor.reduce(nodes[:, 0::2], axis=1)
        levels[:, level, 1] = np.bitwise_xor.reduce(nodes[:, 1::2], axis=1)
    q_tree = q[base:]
    pads = np.stack(
        [_tccr(q_tree, base, stream), _tccr(q_tree ^ _delta_words(delta), base, stream)], axis=1
    ).reshape(s.noise, s.depth, 2, 16)
    leaves = gf128.to_words(nodes.reshape(-1, 16))
    gamma = np.bitwise_xor.reduce(leaves.reshape(s.noise, s.leaves, 2), axis=1) ^ b_base
    message = {"levels": levels ^ pads, "gamma": gamma.view(np.uint8).reshape(-1, 16)}
    return SenderVole(message, compress(code_key, leaves, s.m))


def receiver_vole(
    cots: ReceiverCots,
    levels: np.ndarray,
    gamma: np.ndarray,
    s: Shape,
    code_key: bytes,
    stream: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Step 2 (receiver): ``(A, C)``, each ``(m, 2)`` uint64, from the sender's message
    (``levels`` ``(t, d, 2, 16)``, ``gamma`` ``(t, 16)`` uint8, shapes checked by the caller)."""
    base, trees = WIDTH * s.noise, np.arange(s.noise)
    beta_bits = cots.r[:base].reshape(s.noise, WIDTH)
    betas = np.packbits(beta_bits, axis=1, bitorder="little").view("<u8").reshape(-1, 2)
    c_base = gf128.pack_bits(cots.t[:base].reshape(s.noise, WIDTH, 2))
    off_path = cots.r[base:].reshape(s.noise, s.depth).astype(np.int64)
    opened = _tccr(cots.t[base:], base, stream).reshape(s.noise, s.depth, 16)
    nodes = np.zeros((s.noise, 1, 16), dtype=np.uint8)
    path = np.zeros(s.noise, dtype=np.int64)
    for level in range(s.depth):
        nodes = _children(nodes)
        nodes[trees, 2 * path] = 0  # the unknown node's children
        nodes[trees, 2 * path + 1] = 0
        side = off_path[:, level]
        sums = np.stack(
            [
                np.bitwise_xor.reduce(nodes[:, 0::2], axis=1),
                np.bitwise_xor.reduce(nodes[:, 1::2], axis=1),
            ],
            axis=1,
        )
        sibling = levels[trees, level, side] ^ opened[:, level] ^ sums[trees, side]
        nodes[trees, 2 * path + side] = sibling
        path = 2 * path + (1 - side)
    leaves = gf128.to_words(nodes.reshape(-1, 16)).reshape(s.noise, s.leaves, 2)
    gamma_words = gf128.to_words(gamma)
    leaves[trees, path] = gamma_words ^ np.bitwise_xor.reduce(leaves, axis=1) ^ c_base
    noise = np.zeros((s.noise, s.leaves, 2), dtype=np.uint64)
    noise[trees, path] = betas
    draws = code_draws(code_key, s.m)  # drawn once for both
    a = compress(code_key, noise.reshape(-1, 2), s.m, draws)
    c = compress(code_key, leaves.reshape(-1, 2), s.m, draws)
    return a, c


# ---- the expand-accumulate code -------------------------------------------------------------


def code_draws(code_key: bytes, m: int) -> np.ndarray:
    """``(m, W)`` uint32 draws of the public code key: output ``j`` XORs the accumulated
    positions ``floor(draws[j] N / 2^32)`` (scaled where they are used)."""
    return np.frombuffer(prg(code_key, 4 * m * EXPANDER, _CODE), dtype="<u4").reshape(m, EXPANDER)


def compress(
    code_key: bytes, values: np.ndarray, m: int, draws: np.ndarray | None = None
) -> np.ndarray:
    """The code's transpose on ``(N, 2)`` uint64: accumulate (prefix XOR), then expand
    (``draws``: :func:`code_draws` of the same key, when the caller has them)."""
    accumulated = np.ascontiguousarray(np.bitwise_xor.accumulate(values, axis=0))
    if draws is None:
        draws = code_draws(code_key, m)
    if len(accumulated) >= 1 << 32:
        raise ValueError("the code's length must fit 32 bits")
    kernel = native.kernel()
    if kernel is not None:
        out = np.empty((m, 2), dtype=np.uint64)
        kernel.gather_xor(accumulated, np.ascontiguousarray(draws), out, EXPANDER)
        return out
    positions = (draws.astype(np.uint64) * np.uint64(len(accumulated))) >> np.uint64(32)
    out = accumulated[positions[:, 0]].copy()
    for k in range(1, EXPANDER):
        out ^= accumulated[positions[:, k]]
    return out
