"""The jobs this process is taking part in right now, as the channel consults them.

A wait for a peer's message is the moment a party would otherwise learn nothing for minutes:
while it waits, the channel asks every active watcher (``federation.status.Federation``)
whether the job has failed elsewhere, and tells them what it is waiting for. Kept apart from
the federation itself so that the channel depends on this small registry only.

The registry also holds each agreed job's terms digest by the message job ids its stages use
(:func:`bound`): the channel binds every message it writes under such an id to the digest and
refuses one bound to other terms, so no message of a job run under other terms is ever read.

Both are held per side, in a context variable: the sides of a local run share one process,
each in its own thread, and each hears only its own jobs, as it would in a process of its
own. A thread that a side starts to wait for messages runs in a copy of the side's context
(:func:`in_context`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


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


_ACTIVE: contextvars.ContextVar[tuple[Watcher, ...]] = contextvars.ContextVar(
    "privreg_watchers", default=()
)
# message job id ─▶ the agreed terms' digest
_TERMS: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "privreg_terms", default=()
)


def register(watcher: Watcher) -> None:
    _ACTIVE.set((*_ACTIVE.get(), watcher))


def unregister(watcher: Watcher) -> None:
    _ACTIVE.set(tuple(w for w in _ACTIVE.get() if w is not watcher))


def active() -> list[Watcher]:
    """The jobs this side takes part in right now."""
    return list(_ACTIVE.get())


def in_context(function: Callable[..., T]) -> Callable[..., T]:
    """``function`` to run in another thread as this side: its jobs and their terms."""
    context = contextvars.copy_context()
    return lambda *args, **kwargs: context.run(function, *args, **kwargs)


def check_peers() -> None:
    """Called between a wait's polls: raises the first active job's failure."""
    for watcher in _ACTIVE.get():
        watcher.check()


def check_within(longest: float) -> float:
    """How long a wait may sleep before it calls :func:`check_peers` again: a wait woken by
    its message's arrival still wakes this often, so a peer's failure ends it promptly."""
    return min([longest, *(watcher.check_every() for watcher in _ACTIVE.get())])


def patient(key: Any) -> bool:
    """Called when a wait reaches its timeout: ``True`` if an active job vouches for the
    sender (alive, its side of this job not started yet), so the wait goes on."""
    return any(watcher.patient(key) for watcher in _ACTIVE.get())


@contextlib.contextmanager
def waiting_for(key: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for watcher in _ACTIVE.get():
            stack.enter_context(watcher.waiting(key))
        yield


@contextlib.contextmanager
def bound(job_ids: list[str], terms: str) -> Iterator[None]:
    """While the block runs, messages under ``job_ids`` (and ids derived from them with a
    ``-`` or ``.`` suffix) are bound to ``terms``."""
    token = _TERMS.set((*_TERMS.get(), *((job_id, terms) for job_id in job_ids)))
    try:
        yield
    finally:
        _TERMS.reset(token)


def terms_of(job_id: str) -> str | None:
    """The terms digest messages of ``job_id`` are bound to, ``None`` if unbound (the longest
    registered id that is ``job_id`` or a prefix of it followed by ``-`` or ``.``)."""
    matches = [
        (known, terms) for known, terms in _TERMS.get()
        if job_id == known or (job_id.startswith(known) and job_id[len(known)] in "-.")
    ]  # fmt: skip
    return max(matches, key=lambda match: len(match[0]))[1] if matches else None
