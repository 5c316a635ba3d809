"""The mTLS gRPC transport: identities from certificates, durable idempotent messages, timeouts.

Every server listens on an ephemeral port of 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from demo.orgs import free_port
from federation import certs, identity
from federation.channel import Channel, ChannelError, MessageTimeoutError, RelayError
from federation.party_config import PartyConfig, PartyConfigError
from federation.transport_grpc import GrpcTransport, serve
from storage import codec


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, certs.Issued]:
    folder = tmp_path_factory.mktemp("pki")
    ca = certs.create_ca(folder / "ca")
    issued = {name: certs.issue(ca, name, folder / "parties") for name in ("bank", "ads", "eve")}
    rogue_ca = certs.create_ca(folder / "rogue", name="rogue CA")
    issued["rogue-bank"] = certs.issue(rogue_ca, "bank", folder / "rogue-parties")
    issued["ca"] = ca
    return issued


def config(
    pki: dict[str, certs.Issued],
    party: str,
    root: Path,
    peers: dict[str, int] | None = None,
    port: int = 0,
    cert: str | None = None,
) -> PartyConfig:
    issued = pki[cert or party]
    return PartyConfig(
        party=party,
        root=root / party,
        listen=f"127.0.0.1:{port}",
        ca=pki["ca"].cert,
        cert=issued.cert,
        key=issued.key,
        peers={peer: f"127.0.0.1:{p}" for peer, p in (peers or {}).items()},
        receive_timeout=5.0,
    )


@pytest.fixture
def bank(pki: dict[str, certs.Issued], tmp_path: Path) -> Iterator[tuple[PartyConfig, int]]:
    """The bank's message endpoint, serving from the bank's own folder."""
    own = config(pki, "bank", tmp_path)
    server, port = serve(own)
    yield own, port
    server.stop(None)


def channel(conf: PartyConfig, job: str = "job-1") -> Channel:
    return Channel(conf.root, job, GrpcTransport(conf), timeout=conf.receive_timeout)


def inbox(conf: PartyConfig) -> list[Path]:
    return [p for p in conf.root.rglob("*") if p.is_file()] if conf.root.exists() else []


def test_message_crosses_and_is_stored_once_on_each_side(
    pki: dict[str, certs.Issued], tmp_path: Path, bank: tuple[PartyConfig, int]
) -> None:
    bank_conf, port = bank
    ads_conf = config(pki, "ads", tmp_path, {"bank": port})
    sent = channel(bank_conf).endpoint("bank").send("ads", "scores", np.arange(5.0), round=2)
    ads = channel(ads_conf).endpoint("ads")
    assert ads.receive("bank", "scores", round=2).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    # the receiver persisted it in its own folder; the sender keeps its copy for replay
    (record,) = channel(ads_conf).log()
    assert (record.sender, record.receiver, record.sha256) == ("bank", "ads", sent.sha256)
    assert channel(bank_conf).log() == [record]
    # a re-send of the same bytes is a no-op; other bytes under the key are refused
    channel(bank_conf).endpoint("bank").send("ads", "scores", np.arange(5.0), round=2)
    with pytest.raises(ChannelError, match=r"different payload.*'scores'.*round 2 of job job-1"):
        channel(bank_conf).endpoint("bank").send("ads", "scores", np.ones(5), round=2)
    assert ads.receive("bank", "scores", round=2).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert channel(ads_conf).log() == [record] == channel(bank_conf).log()


def test_a_relayed_message_is_checked_as_its_senders(
    pki: dict[str, certs.Issued], tmp_path: Path, bank: tuple[PartyConfig, int]
) -> None:
    """Ads sends to the bank, the bank relays to eve with ads's signature: eve reads it as
    ads's; a relay whose entry the bank altered, or signed itself, is refused naming ads."""
    _, bank_port = bank
    ads_conf = config(pki, "ads", tmp_path)
    ads_server, ads_port = serve(ads_conf)
    try:
        channel(ads_conf).endpoint("ads").send("bank", "x", {"w": [0.5, 1.5]}, round=2)
        bank = channel(config(pki, "bank", tmp_path, {"ads": ads_port})).endpoint("bank")
        bank.receive("ads", "x", round=2)
        bank.relay(["eve"], "x_relay", "x", ["ads"], round=2)
    finally:
        ads_server.stop(None)
    eve = channel(config(pki, "eve", tmp_path, {"bank": bank_port})).endpoint("eve")
    assert eve.receive_relayed("bank", "x_relay", "x", ["ads"], round=2) == {
        "ads": {"w": [0.5, 1.5]}
    }

    (entry,) = eve.receive("bank", "x_relay", round=2).values()
    other = codec.dumps({"w": [0.5, 2.5]})
    key = bank.channel.key(2, "ads", "bank", "x")
    own = identity.load_own("bank", pki["bank"].cert, pki["bank"].key)
    signed = identity.sign(
        own, identity.statement(vars(key), len(other), hashlib.sha256(other).hexdigest())
    )
    forgeries = {
        "altered": {**entry, "data": other},
        "signed by the relay": {
            "data": other,
            "proof": codec.dumps({"cert": own.chain_pem, "proof": signed}),
        },
    }
    for n, (what, forged) in enumerate(forgeries.items()):
        bank.send("eve", f"y{n}_relay", {"ads": forged}, round=2)
        with pytest.raises(RelayError, match="'x' message from ads to bank in round 2") as error:
            eve.receive_relayed("bank", f"y{n}_relay", "x", ["ads"], round=2)
        assert ("names 'bank', not 'ads'" in str(error.value)) == (what != "altered"), what


def test_a_party_acts_only_as_itself(pki: dict[str, certs.Issued], tmp_path: Path) -> None:
    ads = channel(config(pki, "ads", tmp_path, {"bank": free_port()}))
    with pytest.raises(ChannelError, match="this process is party 'ads'; it cannot act as 'bank'"):
        ads.endpoint("bank")
    with pytest.raises(ChannelError, match="cannot send as bank"):
        ads.transport.put(ads.key(0, "bank", "eve", "x"), b"PRV1N")
    with pytest.raises(ChannelError, match="cannot read the 'x' message from bank to eve"):
        ads.transport.get(ads.key(0, "bank", "eve", "x"), 0.1)


def test_reading_what_is_addressed_to_another_party_is_refused(
    pki: dict[str, certs.Issued], tmp_path: Path, bank: tuple[PartyConfig, int]
) -> None:
    bank_conf, port = bank
    channel(bank_conf).endpoint("bank").send("ads", "labels", [1, 0, 1])
    eve = config(pki, "eve", tmp_path, {"bank": port})
    transport = GrpcTransport(eve)
    key = channel(bank_conf).key(0, "bank", "ads", "labels")
    with pytest.raises(ChannelError, match=r"'eve' asked for the 'labels' .* addressed to ads"):
        transport._fetch(key, time.monotonic() + 5)
    assert inbox(eve) == []


def test_certificates_from_another_ca_are_refused_both_ways(
    pki: dict[str, certs.Issued], tmp_path: Path, bank: tuple[PartyConfig, int]
) -> None:
    bank_conf, port = bank
    channel(bank_conf).endpoint("bank").send("ads", "x", 1)
    # a client whose certificate another CA signed: the bank's endpoint refuses the handshake,
    # and the impostor learns it at once, not after its receive timeout
    impostor = config(pki, "ads", tmp_path / "impostor", {"bank": port}, cert="rogue-bank")
    begin = time.monotonic()
    with pytest.raises(ChannelError, match="refused this party's certificate in the TLS"):
        channel(impostor).endpoint("ads").receive("bank", "x", timeout=30.0)
    assert time.monotonic() - begin < 5 and inbox(impostor) == []
    # a server whose certificate another CA signed, claiming to be the bank (its own checks
    # would refuse to start it: an impostor runs its own code)
    rogue = config(pki, "bank", tmp_path / "rogue", cert="rogue-bank")
    server, rogue_port = serve(rogue, check_own=False)
    try:
        ads = config(pki, "ads", tmp_path / "ads", {"bank": rogue_port})
        with pytest.raises(ChannelError, match=r"mutual TLS with peer bank .* failed"):
            channel(ads).endpoint("ads").receive("bank", "x")
        assert inbox(ads) == []
    finally:
        server.stop(None)


def test_a_valid_certificate_cannot_send_as_another_party(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    """Eve (a valid party) answers at the bank's address with a message 'from the bank'."""
    eve = config(pki, "eve", tmp_path)
    forged = Channel(eve.root, "job-1")  # eve writes a file claiming the bank as sender
    forged.endpoint("bank").send("ads", "x", "forged")
    server, eve_port = serve(eve)
    try:
        ads = config(pki, "ads", tmp_path, {"bank": eve_port})
        with pytest.raises(ChannelError, match=r"mutual TLS with peer bank .* failed"):
            channel(ads).endpoint("ads").receive("bank", "x")
        assert inbox(ads) == []
    finally:
        server.stop(None)


def test_a_taken_port_is_refused_at_start_never_shared(
    pki: dict[str, certs.Issued], tmp_path: Path, bank: tuple[PartyConfig, int]
) -> None:
    """gRPC would share a port through SO_REUSEPORT and split peers' fetches between two
    endpoints; a second endpoint on the bank's port must fail and leave the bank's serving."""
    bank_conf, port = bank
    with pytest.raises(ChannelError, match=rf"party eve: cannot listen on 127.0.0.1:{port}"):
        serve(config(pki, "eve", tmp_path, port=port))
    channel(bank_conf).endpoint("bank").send("ads", "x", {"w": 0.5}, round=1)
    ads = channel(config(pki, "ads", tmp_path, {"bank": port})).endpoint("ads")
    assert ads.receive("bank", "x", round=1) == {"w": 0.5}


def test_a_peer_down_for_a_while_is_waited_for(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    port = free_port()
    bank_conf = config(pki, "bank", tmp_path, port=port)
    channel(bank_conf).endpoint("bank").send("ads", "x", {"w": 0.5}, round=1)
    ads = channel(config(pki, "ads", tmp_path, {"bank": port})).endpoint("ads")
    started: list = []
    later = threading.Timer(1.5, lambda: started.append(serve(bank_conf)[0]))
    later.start()
    try:
        begin = time.monotonic()
        assert ads.receive("bank", "x", round=1, timeout=30) == {"w": 0.5}
        assert time.monotonic() - begin >= 1.0
    finally:
        later.join()
        for server in started:
            server.stop(None)


def test_a_peer_gone_for_good_gives_the_named_timeout(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    ads = channel(config(pki, "ads", tmp_path, {"bank": free_port()}), job="job-7")
    with pytest.raises(
        MessageTimeoutError,
        match=r"gave up after 1 s waiting for the 'residual' message from bank to ads in round 3 "
        r"of job job-7 \(peer bank at 127\.0\.0\.1:\d+",
    ):
        ads.endpoint("ads").receive("bank", "residual", round=3, timeout=1.0)


def test_a_message_larger_than_256_mb_crosses(
    pki: dict[str, certs.Issued], tmp_path: Path, bank: tuple[PartyConfig, int]
) -> None:
    bank_conf, port = bank
    vector = np.arange(33_600_000, dtype=np.float64)  # 268.8 MB
    record = channel(bank_conf).endpoint("bank").send("ads", "big", vector)
    assert record.size > 256 * 2**20
    received = channel(config(pki, "ads", tmp_path, {"bank": port})).endpoint("ads")
    got = received.receive("bank", "big", timeout=120)
    assert got.shape == vector.shape and np.array_equal(got, vector)


def test_a_message_above_the_receivers_cap_is_refused_and_not_stored(
    pki: dict[str, certs.Issued], tmp_path: Path, bank: tuple[PartyConfig, int]
) -> None:
    bank_conf, port = bank
    channel(bank_conf).endpoint("bank").send("ads", "blob", b"x" * 5000)
    ads_conf = config(pki, "ads", tmp_path, {"bank": port})
    small = GrpcTransport(ads_conf, limits=codec.Limits(max_bytes=1000))
    with pytest.raises(ChannelError, match=r"'blob' .*bytes exceed the cap of 1000"):
        Channel(ads_conf.root, "job-1", small).endpoint("ads").receive("bank", "blob")
    assert inbox(ads_conf) == []


def test_party_configuration_is_checked(pki: dict[str, certs.Issued], tmp_path: Path) -> None:
    path = tmp_path / "party.toml"
    body = (
        'party = "ads"\nroot = "home"\nlisten = "127.0.0.1:0"\n[tls]\n'
        f'ca = "{pki["ca"].cert}"\ncert = "{pki["ads"].cert}"\nkey = "{pki["ads"].key}"\n'
    )
    path.write_text(body + '[peers]\nbank = "127.0.0.1:7701"\n')
    loaded = PartyConfig.load(path)
    assert loaded.root == tmp_path / "home" and loaded.address_of("bank") == "127.0.0.1:7701"
    with pytest.raises(PartyConfigError, match="no address for peer 'eve'"):
        loaded.address_of("eve")
    path.write_text(body.replace('party = "ads"', 'party = "x__y"'))
    with pytest.raises(PartyConfigError, match="party 'x__y' must be 1-80"):
        PartyConfig.load(path)
    path.write_text(body.replace('root = "home"\n', ""))
    with pytest.raises(PartyConfigError, match="missing 'root'"):
        PartyConfig.load(path)


_CHILD_ASKS_FOR_A_PORT = """
import socket, sys
from demo.orgs import free_port
taken, real_bind, calls = int(sys.argv[1]), socket.socket.bind, []
def bind(sock, address):  # the OS "chooses" the parent's port first, as it may under load
    calls.append(address)
    return real_bind(sock, (address[0], taken if len(calls) == 1 else address[1]))
socket.socket.bind = bind
print(free_port(), len(calls))
"""


def test_a_port_handed_to_one_process_is_never_handed_to_another() -> None:
    """Test workers write ports into configurations that parties bind later: two workers given
    the same port by the OS in that window would collide, so the choice is reserved."""
    held = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(
        [sys.executable, "-c", _CHILD_ASKS_FOR_A_PORT, str(held)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    port, tries = map(int, run.stdout.split())
    assert tries >= 2 and port != held  # offered the claimed port first, then moved on
