"""Wait for a file to appear, woken by the file system rather than by polling.

Why: a message is a file, and whoever waits for one (a receiver on the shared folder, a
party's endpoint holding a peer's fetch) should learn of it the moment its writer links it
into place, whatever process the writer is. On Linux one inotify descriptor per process
(through ctypes, no dependency) watches the folders that someone waits in, and one thread
wakes the waiters on every name created or moved into them; a waiter then looks with one
``stat``. Elsewhere (or if inotify is unavailable) the wait falls back to looking every
:data:`FALLBACK_POLL` seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
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
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_SAFETY = 1.0  # a waiter looks at least this often even if no event came (missed or lost)


class _Inotify:
    """One descriptor; folders are watched while at least one waiter needs them."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._add, self._rm = libc.inotify_add_watch, libc.inotify_rm_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = libc.inotify_init1(_IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.fd, self.pid = fd, os.getpid()
        self.changed = threading.Condition()
        self._generation = 0
        self._users: dict[str, tuple[int, int]] = {}  # folder -> (watch descriptor, waiters)
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
            with self.changed:
                self._generation += 1
                self.changed.notify_all()

    def hold(self, folder: str) -> bool:
        """Watch ``folder`` for one more waiter; False if it does not exist (yet)."""
        with self.changed:
            held = self._users.get(folder)
            if held is not None:
                self._users[folder] = (held[0], held[1] + 1)
                return True
            wd = self._add(self.fd, os.fsencode(folder), _IN_CREATE | _IN_MOVED_TO)
            if wd < 0:
                return False
            self._users[folder] = (wd, 1)
            return True

    def release(self, folder: str) -> None:
        with self.changed:
            held = self._users.pop(folder, None)
            if held is None:
                return
            wd, users = held
            if users > 1:
                self._users[folder] = (wd, users - 1)
            else:
                self._rm(self.fd, wd)  # fails harmlessly if the folder is gone

    def _moved_on(self, seen: int) -> bool:
        return self._generation != seen

    def wait_for(self, path: Path, deadline: float, go_on: Callable[[], bool]) -> bool:
        held: str | None = None
        try:
            while True:
                # watch the deepest existing folder on the way to the file before looking,
                # so a creation between the look and the wait still wakes the waiter
                folder = _deepest_existing(path.parent)
                if folder != held:
                    if held is not None:
                        self.release(held)
                        held = None
                    if folder is not None and self.hold(folder):
                        held = folder
                with self.changed:
                    seen = self._generation
                    if path.exists():
                        return True
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not go_on():
                        return path.exists()
                    pause = min(remaining, _SAFETY if held is not None else FALLBACK_POLL)
                    self.changed.wait_for(functools.partial(self._moved_on, seen), pause)
        finally:
            if held is not None:
                self.release(held)


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
