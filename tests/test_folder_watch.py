"""The folder watch wakes a waiter for the name it waits for, not for every file created.

Why: an endpoint holds one long poll per peer and message, all in a few folders; if every
file created woke every waiter, a round's writes would cost files x waiters wake-ups (the
busiest thread of a coordinator's endpoint at ten hospitals). The safety re-check is set far
beyond the test's waits, so only the file system's events can wake a waiter here.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from federation import folder_watch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")


def wait_in_thread(path: Path, wakes: list[float]) -> tuple[threading.Thread, list[bool]]:
    """A waiter for ``path`` (up to 60 s) that records each of its wake-ups."""
    found: list[bool] = []

    def go_on() -> bool:
        wakes.append(time.monotonic())
        return True

    def run() -> None:
        found.append(folder_watch.wait_for(path, 60.0, go_on))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, found


def settle(wakes: list[float], count: int = 1) -> None:
    """Until the waiter has looked ``count`` times (it looks once before it sleeps)."""
    deadline = time.monotonic() + 10
    while len(wakes) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_other_files_in_the_folder_do_not_wake_the_waiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(folder_watch, "_SAFETY", 120.0)
    wakes: list[float] = []
    thread, found = wait_in_thread(tmp_path / "wanted", wakes)
    settle(wakes)
    for i in range(40):  # written as the channel writes: a temporary name, then linked
        (tmp_path / f".tmp-{i}").write_bytes(b"x")
        (tmp_path / f"other-{i}").hardlink_to(tmp_path / f".tmp-{i}")
    time.sleep(0.2)
    quiet = len(wakes)
    (tmp_path / "wanted").write_bytes(b"here")
    thread.join(timeout=30)
    assert found == [True]
    assert quiet == 1  # only its first look: 80 names created, none woke it


def test_a_file_in_folders_made_later_wakes_its_waiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(folder_watch, "_SAFETY", 120.0)
    wakes: list[float] = []
    wanted = tmp_path / "job" / "round-3" / "model"
    thread, found = wait_in_thread(wanted, wakes)
    settle(wakes)
    (tmp_path / "unrelated").mkdir()
    wanted.parent.mkdir(parents=True)
    time.sleep(0.1)
    wanted.write_bytes(b"w")
    thread.join(timeout=30)
    assert found == [True] and not thread.is_alive()  # woken by events, not the 60 s deadline
    assert len(wakes) <= 4  # its first look, its folders' creation, the file


def test_folders_made_while_the_watch_is_set_do_not_strand_the_waiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folders on the way appear after the waiter's look but before its watch is set (a
    peer's mkdir racing the wait): no event can tell it, so its second look must."""
    monkeypatch.setattr(folder_watch, "_SAFETY", 120.0)
    wanted = tmp_path / "job" / "round-3" / "model"
    real_hold = folder_watch._Inotify.hold

    def hold_after_a_peers_mkdir(self, folder: str, name: str, event: threading.Event) -> bool:
        if folder == str(tmp_path):
            wanted.parent.mkdir(parents=True, exist_ok=True)  # just before the watch is set
        return real_hold(self, folder, name, event)

    monkeypatch.setattr(folder_watch._Inotify, "hold", hold_after_a_peers_mkdir)
    wakes: list[float] = []
    thread, found = wait_in_thread(wanted, wakes)
    settle(wakes)
    time.sleep(0.1)
    wanted.write_bytes(b"w")
    thread.join(timeout=30)
    assert found == [True] and not thread.is_alive()  # woken by the file, not the deadline
