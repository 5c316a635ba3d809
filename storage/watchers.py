"""The jobs this process is taking part in right now, as the channel's waits consult them.

A wait for a peer's message is the moment a party would otherwise learn nothing for minutes:
while it waits, the channel asks every active watcher (``storage.federation.Federation``)
whether the job has failed elsewhere, and tells them what it is waiting for. Kept apart from
the federation itself so that the channel depends on this small registry only.
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


_ACTIVE: list[Watcher] = []
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


@contextlib.contextmanager
def waiting_for(key: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for watcher in list(_ACTIVE):
            stack.enter_context(watcher.waiting(key))
        yield
