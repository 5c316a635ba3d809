"""The sparse neighbour graph of SecAgg+ (Bell et al., CCS 2020) and its failure bounds.

Why: with a complete graph every party masks against, and shares secrets with, all n - 1
others, so a round costs O(n) per party and O(n^2) in all. SecAgg+ masks only along the edges
of a random k-regular graph with k = O(log n); the sum stays private as long as no honest
party has too many colluding neighbours and the honest survivors stay connected, and both
fail only with a probability that falls exponentially in k.

The graph is a Harary graph H(n, k) (k even: ring positions, each joined to the k/2 nearest
on either side) under a random relabelling of the parties. The relabelling is a public
permutation drawn from a seed all parties derive from the job (:func:`harary_graph`), so the
coordinator cannot choose who neighbours whom.

Failure bounds, for ``c = floor(corrupt_fraction * n)`` parties colluding with the
coordinator and ``d = floor(dropout_fraction * n)`` dropping out (the coordinator may also
*declare* parties dropped, so the privacy bound counts ``c + d`` removed parties). Under the
random relabelling a party's k neighbours are a uniform k-subset of the other n - 1, so:

* **one party unmasked** (event A): a party's self-mask is t-of-(k + 1) shared among itself
  and its neighbours, and unmasking its input needs its self-mask and every pairwise seed.
  Honest neighbours answer one unmask request per round, so the coordinator needs t - 1
  colluding neighbours: ``P_A <= n * P[Hyp(n - 1, c, k) >= t - 1]``.
* **a partial sum revealed** (event B): the honest survivors' masks cancel only in their sum
  over a connected part of the graph; H(n, k) minus a set of positions is disconnected only if
  two runs of k/2 consecutive positions are removed, so (union bound over one run)
  ``P_B <= n * C(n - k/2, m - k/2) / C(n, m)`` with ``m = c + d``.
* **a round cannot finish** (correctness, event C): a sender's self-mask needs t of its k + 1
  holders; ``P_C <= n * P[Hyp(n - 1, d, k) >= k + 2 - t]``.

:func:`choose_parameters` takes the smallest even k (and then the threshold t) with
``P_A + P_B <= 2^-privacy_bits`` and ``P_C <= 2^-correctness_bits``; when no k < n - 1 does,
the graph is complete and the bounds are those of the complete graph.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from core.secagg.errors import ConfigError

#: Defaults: up to a fifth of the parties collude with the coordinator, a tenth drop out per
#: round; the privacy failure probability is at most 2^-40, a failed round at most 2^-20.
DEFAULT_CORRUPT_FRACTION = 0.2
DEFAULT_DROPOUT_FRACTION = 0.1
DEFAULT_PRIVACY_BITS = 40
DEFAULT_CORRECTNESS_BITS = 20


@dataclass(frozen=True)
class GraphParameters:
    """A neighbour count k, a self-mask threshold t, and their failure bounds (as computed)."""

    n_parties: int
    degree: int  # k; n - 1 means the complete graph
    threshold: int  # t of the k + 1 holders of a party's self-mask shares
    corrupt_fraction: float
    dropout_fraction: float
    privacy_failure: float  # bound on P_A + P_B
    correctness_failure: float  # bound on P_C

    @property
    def complete(self) -> bool:
        return self.degree >= self.n_parties - 1

    def describe(self) -> str:
        return (
            f"n={self.n_parties}: k={self.degree}{' (complete)' if self.complete else ''}, "
            f"t={self.threshold}; privacy failure <= {_power(self.privacy_failure)}, "
            f"round failure <= {_power(self.correctness_failure)} "
            f"(corrupt {self.corrupt_fraction:g}, dropout {self.dropout_fraction:g})"
        )


@dataclass(frozen=True)
class NeighbourGraph:
    """Who masks with whom: a symmetric neighbour list per party."""

    parties: tuple[str, ...]
    neighbours: Mapping[str, tuple[str, ...]]

    def degree(self) -> int:
        return max(len(v) for v in self.neighbours.values())


def hypergeometric_tail(population: int, marked: int, draws: int, at_least: int) -> Fraction:
    """Exact P[X >= at_least] for X marked items among ``draws`` drawn without replacement."""
    if at_least <= 0:
        return Fraction(1)
    total = math.comb(population, draws)
    hits = sum(
        math.comb(marked, x) * math.comb(population - marked, draws - x)
        for x in range(at_least, min(marked, draws) + 1)
    )
    return Fraction(hits, total)


def failure_bounds(
    n: int, degree: int, threshold: int, corrupt_fraction: float, dropout_fraction: float
) -> tuple[Fraction, Fraction]:
    """``(P_A + P_B, P_C)`` bounds of the module docstring for H(n, degree) and threshold."""
    c, d = math.floor(corrupt_fraction * n), math.floor(dropout_fraction * n)
    k = min(degree, n - 1)
    one_party = min(Fraction(1), n * hypergeometric_tail(n - 1, c, k, threshold - 1))
    removed, run = min(c + d, n), k // 2
    if k >= n - 1 or removed < run:
        partial = Fraction(0)  # complete graph, or too few removed to cut one run
    else:
        partial = Fraction(n * math.comb(n - run, removed - run), math.comb(n, removed))
    stuck = min(Fraction(1), n * hypergeometric_tail(n - 1, d, k, k + 2 - threshold))
    return min(Fraction(1), one_party + partial), stuck


def choose_parameters(
    n: int,
    corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION,
    dropout_fraction: float = DEFAULT_DROPOUT_FRACTION,
    privacy_bits: int = DEFAULT_PRIVACY_BITS,
    correctness_bits: int = DEFAULT_CORRECTNESS_BITS,
) -> GraphParameters:
    """Smallest even degree k (then smallest t > (k + 1) / 2) meeting both failure targets.

    Why t > (k + 1) / 2: the same majority rule as the complete graph's threshold, so two
    disjoint groups of a party's holders cannot each rebuild one of its secrets.
    """
    if n < 2:
        raise ConfigError(f"a neighbour graph needs at least 2 parties, got {n}")
    if not (0 <= corrupt_fraction < 1 and 0 <= dropout_fraction < 1):
        raise ConfigError(
            f"corrupt and dropout fractions must be in [0, 1), got {corrupt_fraction}, "
            f"{dropout_fraction}"
        )
    privacy_target = Fraction(1, 2**privacy_bits)
    correctness_target = Fraction(1, 2**correctness_bits)
    for k in range(2, n - 1, 2):
        for t in range((k + 1) // 2 + 1, k + 2):
            privacy, correctness = failure_bounds(n, k, t, corrupt_fraction, dropout_fraction)
            if correctness > correctness_target:
                break  # a larger t only makes rounds fail more often
            if privacy <= privacy_target:
                return GraphParameters(
                    n, k, t, corrupt_fraction, dropout_fraction, float(privacy), float(correctness)
                )
    k = n - 1
    t = (k + 1) // 2 + 1
    privacy, correctness = failure_bounds(n, k, t, corrupt_fraction, dropout_fraction)
    return GraphParameters(
        n, k, t, corrupt_fraction, dropout_fraction, float(privacy), float(correctness)
    )


def harary_graph(parties: Sequence[str], degree: int, seed: bytes) -> NeighbourGraph:
    """H(n, degree) over a public random relabelling of ``parties`` drawn from ``seed``.

    ``degree >= n - 1`` gives the complete graph. An odd degree below n - 1 is refused (the
    ring construction is symmetric only for even k).
    """
    names = tuple(parties)
    n = len(names)
    if n < 2 or len(set(names)) != n:
        raise ConfigError(f"need at least 2 distinct parties, got {list(names)}")
    if degree >= n - 1:
        return NeighbourGraph(names, {p: tuple(q for q in names if q != p) for p in names})
    if degree < 2 or degree % 2:
        raise ConfigError(f"degree must be even and at least 2 below n - 1, got {degree}")
    ring = _shuffled(names, seed)
    half = degree // 2
    neighbours = {
        ring[i]: tuple(ring[(i + s) % n] for s in range(-half, half + 1) if s != 0)
        for i in range(n)
    }
    return NeighbourGraph(names, neighbours)


def graph_seed(job_id: str, parties: Sequence[str]) -> bytes:
    """Public seed of a job's graph: every party derives it, nobody chooses it."""
    digest = hashlib.sha256(b"privreg/secagg/graph/v1")
    for field in (job_id, *parties):
        digest.update(len(field.encode()).to_bytes(4, "big") + field.encode())
    return digest.digest()


def connected(nodes: Sequence[str], graph: NeighbourGraph) -> bool:
    """Whether ``nodes`` induce a connected subgraph (what event B is about)."""
    keep = set(nodes)
    if not keep:
        return True
    start = next(iter(keep))
    seen, todo = {start}, [start]
    while todo:
        for peer in graph.neighbours[todo.pop()]:
            if peer in keep and peer not in seen:
                seen.add(peer)
                todo.append(peer)
    return seen == keep


def _shuffled(names: tuple[str, ...], seed: bytes) -> list[str]:
    """Fisher-Yates with an HMAC-SHA256 counter stream (rejection sampling, no modulo bias)."""
    order, counter = list(names), 0
    for i in range(len(order) - 1, 0, -1):
        bound = i + 1
        limit = (2**64 // bound) * bound
        while True:
            block = hmac.new(seed, counter.to_bytes(8, "big"), hashlib.sha256).digest()
            counter += 1
            value = int.from_bytes(block[:8], "big")
            if value < limit:
                break
        j = value % bound
        order[i], order[j] = order[j], order[i]
    return order


def _power(value: float) -> str:
    return "0" if value <= 0 else f"2^{math.log2(value):.1f}"
