"""Median CPU and wall time of an action: one definition for privreg's benchmarks and the peers'
drivers, which run as scripts from this folder in the peers' own virtualenvs (so it imports
nothing but the standard library)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(action: Callable[[], object], repeats: int = 3) -> tuple[float, float]:
    """Median (CPU seconds of this process, wall seconds) of ``repeats`` runs of ``action``."""
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        action()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)
