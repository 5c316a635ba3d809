"""The jobs this process is taking part in right now, as the channel consults them.

A wait for a peer's message is the moment a party would otherwise learn nothing for minutes:
while it waits, the channel asks every active watcher (``storage.federation.Federation``)
whether the job has failed elsewhere, and tells them what it is waiting for. Kept apart from
the federation itself so that the channel depends on this small registry only.

The registry also holds each agreed job's terms digest by the message job ids its stages use
(:func:`bound`): the channel binds every message it writes under such an id to the digest and
refuses one bound to other terms, so no message of a job run under other terms is ever read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol


class Watcher(Protocol):
    def check(self) -> None:
        """Raise the job's failure (a peer failed, aborted or is gone) if there is one."""

    def waiting(self, what: Any) -> contextlib.AbstractContextManager[None]:
        """Record that this party waits for ``what`` (a message key) while the block runs."""

    def patient(self, what: Any) -> bool:
        """Whether a wait for ``what`` that reached its timeout should go on: its sender is
        alive and has not reached this job yet (busy with an earlier job of its own)."""

    def check_every(self) -> float:
        """Seconds between the waiting thread's calls of :meth:`check` that this job needs
        (how soon a peer's failure ends the wait, how often the shown state refreshes)."""


_ACTIVE: list[Watcher] = []
_TERMS: dict[str, str] = {}  # message job id ─▶ the agreed terms' digest
_LOCK = threading.Lock()


def register(watcher: Watcher) -> None:
    with _LOCK:
        _ACTIVE.append(watcher)


def unregister(watcher: Watcher) -> None:
    with _LOCK:
        if watcher in _ACTIVE:
            _ACTIVE.remove(watcher)


def active() -> list[Watcher]:
    """The jobs this process takes part in right now."""
    with _LOCK:
        return list(_ACTIVE)


def check_peers() -> None:
    """Called between a wait's polls: raises the first active job's failure."""
    for watcher in list(_ACTIVE):
        watcher.check()


def check_within(longest: float) -> float:
    """How long a wait may sleep before it calls :func:`check_peers` again: a wait woken by
    its message's arrival still wakes this often, so a peer's failure ends it promptly."""
    return min([longest, *(watcher.check_every() for watcher in list(_ACTIVE))])


def patient(key: Any) -> bool:
    """Called when a wait reaches its timeout: ``True`` if an active job vouches for the
    sender (alive, its side of this job not started yet), so the wait goes on."""
    return any(watcher.patient(key) for watcher in list(_ACTIVE))


@contextlib.contextmanager
def waiting_for(key: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for watcher in list(_ACTIVE):
            stack.enter_context(watcher.waiting(key))
        yield


@contextlib.contextmanager
def bound(job_ids: list[str], terms: str) -> Iterator[None]:
    """While the block runs, messages under ``job_ids`` (and ids derived from them with a
    ``-`` or ``.`` suffix) are bound to ``terms``."""
    with _LOCK:
        _TERMS.update(dict.fromkeys(job_ids, terms))
    try:
        yield
    finally:
        with _LOCK:
            for job_id in job_ids:
                if _TERMS.get(job_id) == terms:
                    del _TERMS[job_id]


def terms_of(job_id: str) -> str | None:
    """The terms digest messages of ``job_id`` are bound to, ``None`` if unbound (the longest
    registered id that is ``job_id`` or a prefix of it followed by ``-`` or ``.``)."""
    with _LOCK:
        matches = [
            known for known in _TERMS
            if job_id == known or (job_id.startswith(known) and job_id[len(known)] in "-.")
        ]  # fmt: skip
        return _TERMS[max(matches, key=len)] if matches else None
