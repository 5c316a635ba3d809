"""A message is read as soon as it is stored, on both transports: nobody polls with sleeps
between a message's arrival and its delivery (the wait is woken by the file's creation).

Why structural: a timed assertion would fail on a loaded machine, so the latency itself
(under 50 ms on loopback is the target) is measured by ``make bench-horizontal``; here every
thread's pauses are recorded while the receiver waits for a message sent 0.3 s later, and the
fetches counted. Also here: what makes a hop cheap without weakening it (a broadcast is
written and synced once; a received copy is not synced, and a torn one is fetched again).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from federation import certs
from federation.channel import Channel, MessageConflictError, MessageKey
from federation.party_config import PartyConfig
from federation.transport_grpc import GrpcTransport, serve


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Every pause any thread takes with ``time.sleep`` (the receiver, the endpoint), except
    the test's own sender waiting to send."""
    pauses: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread().name != "sender":
            pauses.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    yield pauses


def send_later(send: Callable[[], Any], delay: float = 0.3) -> threading.Timer:
    timer = threading.Timer(delay, send)
    timer.name = "sender"
    timer.start()
    return timer


def test_the_file_transport_is_woken_by_the_message_not_a_poll(
    tmp_path: Path, sleeps: list[float]
) -> None:
    channel = Channel(tmp_path, "delivery-job")
    timer = send_later(lambda: channel.endpoint("bank").send("ads", "scores", [1, 2, 3]))
    assert channel.endpoint("ads").receive("bank", "scores", timeout=30) == [1, 2, 3]
    timer.join()
    assert sleeps == []  # the receiver waited on the folder's watch, never slept to look again


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, certs.Issued]:
    folder = tmp_path_factory.mktemp("pki")
    ca = certs.create_ca(folder / "ca")
    issued = {name: certs.issue(ca, name, folder / "parties") for name in ("bank", "ads")}
    issued["ca"] = ca
    return issued


def party(
    pki: dict[str, certs.Issued], name: str, root: Path, peers: dict[str, int]
) -> PartyConfig:
    return PartyConfig(
        party=name,
        root=root / name,
        listen="127.0.0.1:0",
        ca=pki["ca"].cert,
        cert=pki[name].cert,
        key=pki[name].key,
        peers={peer: f"127.0.0.1:{port}" for peer, port in peers.items()},
        receive_timeout=30.0,
    )


def test_grpc_receive_is_one_long_poll_answered_on_arrival(
    pki: dict[str, certs.Issued],
    tmp_path: Path,
    sleeps: list[float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bank = party(pki, "bank", tmp_path, {})
    server, port = serve(bank)
    try:
        ads = party(pki, "ads", tmp_path, {"bank": port})
        sender = Channel(bank.root, "delivery-job", GrpcTransport(bank)).endpoint("bank")
        receiver = Channel(ads.root, "delivery-job", GrpcTransport(ads)).endpoint("ads")
        fetches: list[float] = []
        real_fetch = GrpcTransport._fetch

        def fetch(self: GrpcTransport, *args: Any) -> Any:
            fetches.append(time.monotonic())
            return real_fetch(self, *args)

        monkeypatch.setattr(GrpcTransport, "_fetch", fetch)
        timer = send_later(lambda: sender.send("ads", "scores", [4, 5]))
        assert receiver.receive("bank", "scores", timeout=30) == [4, 5]
        timer.join()
    finally:
        server.stop(None)
    # the receiver asked once and the sender's endpoint answered when the message was stored:
    # no pause of the receiver's or the endpoint's, no second request
    assert sleeps == [] and len(fetches) == 1


def test_a_broadcast_is_one_synced_file_under_each_receivers_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = Channel(tmp_path, "broadcast-job")
    syncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd)))
    peers = ["ads", "bank", "clinic"]
    records = channel.endpoint("hub").send_many(peers, "model", {"w": [1.5]}, round=3)
    assert len(syncs) == 2  # the file's data and its folder's names, not two per receiver
    paths = [channel.transport.store().path(r.key) for r in records]
    assert len({p.stat().st_ino for p in paths}) == 1 and paths[0].stat().st_nlink == 3
    for peer in peers:
        assert channel.endpoint(peer).receive("hub", "model", round=3) == {"w": [1.5]}
    channel.endpoint("hub").send_many(peers, "model", {"w": [1.5]}, round=3)  # idempotent
    with pytest.raises(MessageConflictError, match="different payload"):
        channel.endpoint("hub").send_many(["ads", "dora"], "model", {"w": [2.0]}, round=3)
    assert channel.endpoint("dora").receive("hub", "model", round=3, timeout=0) == {"w": [2.0]}


def test_a_received_copy_is_unsynced_and_a_torn_one_is_fetched_again(
    pki: dict[str, certs.Issued], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bank = party(pki, "bank", tmp_path, {})
    server, port = serve(bank)
    try:
        ads = party(pki, "ads", tmp_path, {"bank": port})
        Channel(bank.root, "torn-job", GrpcTransport(bank)).endpoint("bank").send(
            "ads", "scores", list(range(100))
        )
        syncs: list[int] = []
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd)))
        first = Channel(ads.root, "torn-job", GrpcTransport(ads)).endpoint("ads")
        assert first.receive("bank", "scores", timeout=30) == list(range(100))
        assert syncs == []  # the sender's copy is the durable one
        key = MessageKey("torn-job", 0, "bank", "ads", "scores")
        stored = GrpcTransport(ads).store().path(key)
        stored.write_bytes(b"\0" * 40)  # what a crash of the machine may leave
        fetches: list[MessageKey] = []
        real_fetch = GrpcTransport._fetch
        monkeypatch.setattr(
            GrpcTransport,
            "_fetch",
            lambda self, k, d: (fetches.append(k), real_fetch(self, k, d))[1],
        )
        restarted = Channel(ads.root, "torn-job", GrpcTransport(ads)).endpoint("ads")
        assert restarted.receive("bank", "scores", timeout=30) == list(range(100))
        assert fetches == [key]  # the torn copy was not trusted: fetched again and replaced
        again = Channel(ads.root, "torn-job", GrpcTransport(ads)).endpoint("ads")
        assert again.receive("bank", "scores", timeout=30) == list(range(100))
        assert fetches == [key]  # an intact copy is read locally
    finally:
        server.stop(None)
