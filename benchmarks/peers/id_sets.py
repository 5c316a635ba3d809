"""The ids of every PSI benchmark: one party's ``count`` ids, the first ``shared`` of them
common to both parties (``user-…``), the rest its own (``<prefix>-only-…``).

Dependency-free on purpose: bench_psi imports it, and so do the peers' drivers, which run
from this folder with their own virtualenvs' python (never privreg's)."""

from __future__ import annotations

from collections.abc import Iterator


def party_ids(count: int, shared: int, prefix: str) -> Iterator[str]:
    yield from (f"user-{i:09d}" for i in range(shared))
    yield from (f"{prefix}-only-{i:09d}" for i in range(count - shared))


def make_sets(small: int, size: int) -> tuple[list[str], list[str]]:
    """Party a's ``small`` ids and party b's ``size``, sharing ``small // 2``."""
    shared = small // 2
    return list(party_ids(small, shared, "a")), list(party_ids(size, shared, "b"))
