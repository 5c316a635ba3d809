"""A message is read as soon as it is stored, on both transports: no wait of the receiver's
own sits between a message's arrival and its delivery.

Why structural: a timed assertion would fail on a loaded machine, so the latency itself
(under 50 ms on loopback is the target) is measured by ``make bench-horizontal``; here the
receiving thread is watched while it waits for a message sent 0.3 s later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from storage import certs
from storage.channel import POLL, Channel
from storage.party_config import PartyConfig
from storage.transport_grpc import GrpcTransport, serve


@pytest.fixture
def receiver_sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Every pause the test's own thread (the receiver) takes, in seconds."""
    pauses: list[float] = []
    me, real_sleep = threading.get_ident(), time.sleep

    def sleep(seconds: float) -> None:
        if threading.get_ident() == me:
            pauses.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    yield pauses


def send_later(send: Callable[[], Any], delay: float = 0.3) -> threading.Timer:
    timer = threading.Timer(delay, send)
    timer.start()
    return timer


def test_the_file_transport_looks_at_least_every_poll_interval(
    tmp_path: Path, receiver_sleeps: list[float]
) -> None:
    channel = Channel(tmp_path, "delivery-job")
    timer = send_later(lambda: channel.endpoint("bank").send("ads", "scores", [1, 2, 3]))
    assert channel.endpoint("ads").receive("bank", "scores", timeout=30) == [1, 2, 3]
    timer.join()
    assert receiver_sleeps and max(receiver_sleeps) <= POLL <= 0.01  # never a longer pause


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
    receiver_sleeps: list[float],
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
    # no pause of the receiver's own, no second request
    assert receiver_sleeps == [] and len(fetches) == 1
