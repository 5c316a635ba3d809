"""CPU seconds of labelled processes and all their descendants within a span of wall time.

Why: ``RUSAGE_CHILDREN`` counts a process tree only once it has been waited for, and not the
pool workers a party starts through multiprocessing's fork server (they are that server's
children, never waited for by the party). Sampling ``/proc/<pid>/stat`` (Linux) every tenth of
a second sees every process of the tree, and gives each one's CPU at any moment, so a job's
CPU can be cut to the job's own span (after start-up) and split by process.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


class ProcessCpu:
    """Samples the CPU of the watched processes (:meth:`watch`) and their descendants in a
    thread; a descendant is labelled ``<its watched ancestor's label> children``."""

    def __init__(self, interval: float = 0.1) -> None:
        self._roots: dict[int, str] = {}
        self._interval = interval
        self._samples: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self._labels: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int, label: str) -> None:
        self._roots[pid] = label

    def __enter__(self) -> ProcessCpu:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)

    def sample(self) -> None:
        now = time.time()
        stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
        for pid, (_parent, cpu) in stats.items():
            label = self._labels.get(pid) or self._label(pid, stats)
            if label is not None:
                self._labels[pid] = label
                self._samples[pid].append((now, cpu))

    def _label(self, pid: int, stats: dict[int, tuple[int, float]]) -> str | None:
        if pid in self._roots:
            return self._roots[pid]
        ancestor = stats[pid][0]
        while ancestor in stats and ancestor not in self._roots:
            ancestor = stats[ancestor][0]
        return f"{self._roots[ancestor]} children" if ancestor in self._roots else None

    def between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per label spent from ``start`` to ``end`` (epoch seconds)."""

        def at(series: list[tuple[float, float]], moment: float) -> float:
            before = [cpu for when, cpu in series if when <= moment]
            return before[-1] if before else 0.0

        spent: dict[str, float] = defaultdict(float)
        for pid, series in self._samples.items():
            spent[self._labels[pid]] += at(series, end) - at(series, start)
        return dict(spent)
