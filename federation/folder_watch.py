"""Wait for a file to appear, woken by the file system rather than by polling.

Why: a message is a file, and whoever waits for one (a receiver on the shared folder, a
party's endpoint holding a peer's fetch) should learn of it the moment its writer links it
into place, whatever process the writer is. On Linux one inotify descriptor per process
(through ctypes, no dependency) watches the folders that someone waits in, and one thread
reads its events and wakes the waiters of each name created or moved into them; a waiter
then looks with one ``stat``. Elsewhere (or if inotify is unavailable) the wait falls back
to looking every :data:`FALLBACK_POLL` seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

FALLBACK_POLL = 0.005
"""Seconds between looks where inotify is unavailable."""

_IN_CREATE, _IN_MOVED_TO, _IN_DELETE_SELF, _IN_IGNORED = 0x100, 0x80, 0x400, 0x8000
_IN_Q_OVERFLOW = 0x4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_SAFETY = 1.0  # a waiter looks at least this often even if no event came (missed or lost)


class _Inotify:
    """One descriptor; folders are watched while at least one waiter needs them, and an
    event wakes only the waiters of the name it is about.

    Why by name: an endpoint holds a long poll per peer and message it waits for (a
    coordinator's, ten hospitals' calls, requests, relays and models), all in the same few
    folders; waking every waiter on every file created made a round's writes cost
    (files x waiters) wake-ups, the busiest thread of a coordinator's endpoint."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._add, self._rm = libc.inotify_add_watch, libc.inotify_rm_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = libc.inotify_init1(_IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.fd, self.pid = fd, os.getpid()
        self._lock = threading.Lock()
        self._folders: dict[str, tuple[int, int]] = {}  # folder -> (watch descriptor, waiters)
        self._by_wd: dict[int, str] = {}
        self._waiters: dict[tuple[str, str], set[threading.Event]] = {}  # (folder, name)
        threading.Thread(target=self._read, name="folder-watch", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            with self._lock:
                woken = self._woken_by(data)
            for event in woken:
                event.set()

    def _woken_by(self, data: bytes) -> set[threading.Event]:
        """The waiters ``data``'s events concern (under the lock): those waiting for the
        name created or moved in, all of a folder gone, everyone if the queue overflowed."""
        woken: set[threading.Event] = set()
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
            offset += _EVENT.size + length
            if mask & _IN_Q_OVERFLOW:
                for waiting in self._waiters.values():
                    woken |= waiting
                continue
            folder = self._by_wd.get(wd)
            if folder is None:
                continue
            if mask & (_IN_DELETE_SELF | _IN_IGNORED):
                for (where, _), waiting in self._waiters.items():
                    if where == folder:
                        woken |= waiting
                continue
            name = os.fsdecode(raw.rstrip(b"\0"))
            woken |= self._waiters.get((folder, name), set())
        return woken

    def hold(self, folder: str, name: str, event: threading.Event) -> bool:
        """Watch ``folder`` for ``event``'s waiter, who waits for ``name`` in it; False if
        the folder does not exist (yet)."""
        with self._lock:
            held = self._folders.get(folder)
            if held is None:
                wd = self._add(self.fd, os.fsencode(folder), _IN_CREATE | _IN_MOVED_TO)
                if wd < 0:
                    return False
                self._by_wd[wd] = folder
                held = (wd, 0)
            self._folders[folder] = (held[0], held[1] + 1)
            self._waiters.setdefault((folder, name), set()).add(event)
            return True

    def release(self, folder: str, name: str, event: threading.Event) -> None:
        with self._lock:
            waiting = self._waiters.get((folder, name))
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[(folder, name)]
            held = self._folders.pop(folder, None)
            if held is None:
                return
            wd, users = held
            if users > 1:
                self._folders[folder] = (wd, users - 1)
            else:
                self._by_wd.pop(wd, None)
                self._rm(self.fd, wd)  # fails harmlessly if the folder is gone

    def wait_for(self, path: Path, deadline: float, go_on: Callable[[], bool]) -> bool:
        event = threading.Event()
        held: tuple[str, str] | None = None
        try:
            while True:
                # cleared first, then the deepest existing folder on the way to the file is
                # watched (for the next name on the way) before looking, so a creation after
                # the watch is set still wakes the waiter; and a folder on the way made
                # before the watch was set is seen by the second look, not lost
                event.clear()
                folder = _deepest_existing(path.parent)
                target = None if folder is None else (folder, _next_name(path, folder))
                if target != held:
                    if held is not None:
                        self.release(*held, event)
                        held = None
                    if target is not None and self.hold(*target, event):
                        held = target
                if path.exists():
                    return True
                if folder is not None and _deepest_existing(path.parent) != folder:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not go_on():
                    return path.exists()
                event.wait(min(remaining, _SAFETY if held is not None else FALLBACK_POLL))
        finally:
            if held is not None:
                self.release(*held, event)


def _next_name(path: Path, folder: str) -> str:
    """The name, directly in ``folder``, on the way to ``path`` (the file itself, or the
    first of its missing folders)."""
    return Path(path).relative_to(folder).parts[0]


def _deepest_existing(folder: Path) -> str | None:
    for candidate in (folder, *folder.parents):
        if candidate.is_dir():
            return str(candidate)
    return None


_WATCH: _Inotify | None = None
_WATCH_FAILED = False
_WATCH_LOCK = threading.Lock()


def _watch() -> _Inotify | None:
    """This process's watcher (a forked child makes its own), None where there is none."""
    global _WATCH, _WATCH_FAILED
    with _WATCH_LOCK:
        if _WATCH_FAILED or not sys.platform.startswith("linux"):
            return None
        if _WATCH is None or _WATCH.pid != os.getpid():
            try:
                _WATCH = _Inotify()
            except (OSError, AttributeError):
                _WATCH_FAILED = True
                return None
        return _WATCH


def wait_for(path: Path, timeout: float, go_on: Callable[[], bool] = lambda: True) -> bool:
    """Whether ``path`` exists within ``timeout`` seconds; returns as soon as it is created
    (or ``go_on()`` turns false, checked on every wake-up)."""
    deadline = time.monotonic() + timeout
    watch = _watch()
    if watch is not None:
        return watch.wait_for(path, deadline, go_on)
    while not path.exists():
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not go_on():
            return path.exists()
        time.sleep(min(FALLBACK_POLL, remaining))
    return True
