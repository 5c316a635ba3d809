"""The party endpoint: one identity rule and pins, per-peer limits, per-kind caps, its own
checks at start, and certificate renewal while fetches run.

Endpoints are served in this process on ephemeral ports of 127.0.0.1; the start-up checks
run the real ``privreg party serve`` as subprocesses.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_network_channel import channel, config, inbox

from federation import certs
from federation.channel import Channel, ChannelError
from federation.endpoint_limits import EndpointLimits
from federation.identity import fingerprint, load_chain
from federation.message_caps import MessageCaps
from federation.party_config import PartyConfig, PartyConfigError
from federation.transport_grpc import GrpcTransport, _NotYetError, _RetryError, serve
from storage import codec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, certs.Issued]:
    folder = tmp_path_factory.mktemp("pki")
    ca = certs.create_ca(folder / "ca")
    issued = {n: certs.issue(ca, n, folder / "parties") for n in ("bank", "ads", "eve", "lab")}
    issued["ca"] = ca
    # CN and SAN differ: the caller "ads" by its CN, "eve" by its SAN; a server "bank" by SAN
    issued["ads-cn-eve-san"] = certs.issue(
        ca, "ads", folder / "mixed-client", common_name="ads", dns_names=["eve"]
    )
    issued["bank-san-other-cn"] = certs.issue(
        ca, "bank", folder / "mixed-server", common_name="other", dns_names=["bank"]
    )
    return issued


def fp(issued: certs.Issued) -> str:
    return fingerprint(load_chain(issued.cert.read_bytes())[0])


def started(conf: PartyConfig, **kw: object) -> tuple[grpc.Server, int]:
    return serve(conf, **kw)  # type: ignore[arg-type]


# ---- one identity rule, pins --------------------------------------------------------------


def test_a_certificate_whose_cn_and_san_differ_is_refused_at_both_ends(
    pki: dict[str, certs.Issued], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bank_conf = config(pki, "bank", tmp_path)
    server, port = started(bank_conf)
    try:
        channel(bank_conf).endpoint("bank").send("ads", "x", 1)
        # the caller: CN "ads", SAN "eve"; before, the endpoint read the CN and served it
        mixed = config(pki, "ads", tmp_path / "mixed", {"bank": port}, cert="ads-cn-eve-san")
        with (
            caplog.at_level(logging.WARNING, logger="privreg.endpoint"),
            pytest.raises(ChannelError, match=r"CN 'ads' and DNS SAN 'eve' differ"),
        ):
            channel(mixed).endpoint("ads").receive("bank", "x", timeout=10)
        assert inbox(mixed) == []
        # the refusal is logged with the caller's address and the names it presented
        (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert "ipv4:127.0.0.1:" in line and "CN ['ads'], DNS SAN ['eve']" in line
        # the same party with a certificate by the rule is served
        good = config(pki, "ads", tmp_path / "good", {"bank": port})
        assert channel(good).endpoint("ads").receive("bank", "x", timeout=10) == 1
    finally:
        server.stop(None)
    # the server: SAN "bank" passes gRPC's host-name check, its CN "other" does not pass the rule
    rogue = config(pki, "bank", tmp_path / "rogue", cert="bank-san-other-cn")
    channel(rogue).endpoint("bank").send("ads", "x", "forged")
    server, port = started(rogue, check_own=False)
    try:
        ads = config(pki, "ads", tmp_path / "ads", {"bank": port})
        with pytest.raises(ChannelError, match=r"CN 'other' and DNS SAN 'bank' differ"):
            channel(ads).endpoint("ads").receive("bank", "x", timeout=10)
        assert inbox(ads) == []
    finally:
        server.stop(None)


def test_a_pinned_fingerprint_that_does_not_match_is_refused_at_both_ends(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    wrong = "sha256:" + "0" * 64
    # the endpoint pins the caller "ads" to another certificate
    bank_conf = replace(config(pki, "bank", tmp_path), pins={"ads": wrong})
    server, port = started(bank_conf)
    try:
        channel(bank_conf).endpoint("bank").send("ads", "x", 1)
        channel(bank_conf).endpoint("bank").send("eve", "x", 2)
        ads = config(pki, "ads", tmp_path, {"bank": port})
        with pytest.raises(ChannelError, match=r"refuses the caller's .* not the one pinned"):
            channel(ads).endpoint("ads").receive("bank", "x", timeout=10)
        eve = config(pki, "eve", tmp_path, {"bank": port})  # not pinned: served
        assert channel(eve).endpoint("eve").receive("bank", "x", timeout=10) == 2
    finally:
        server.stop(None)
    # the receiver pins the sender "bank": another certificate of the CA for "bank" is refused
    bank_conf = config(pki, "bank", tmp_path / "two")
    server, port = started(bank_conf)
    try:
        channel(bank_conf).endpoint("bank").send("ads", "y", 3)
        pinned = replace(config(pki, "ads", tmp_path / "two", {"bank": port}), pins={"bank": wrong})
        with pytest.raises(ChannelError, match=r"bank's certificate sha256:\w+ is not the one"):
            channel(pinned).endpoint("ads").receive("bank", "y", timeout=10)
        assert inbox(pinned) == []
        right = replace(pinned, pins={"bank": fp(pki["bank"])}, root=tmp_path / "right")
        assert channel(right).endpoint("ads").receive("bank", "y", timeout=10) == 3
    finally:
        server.stop(None)


def test_pins_and_limits_are_read_from_party_toml(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    path = tmp_path / "party.toml"
    body = (
        'party = "ads"\nroot = "home"\n[tls]\n'
        f'ca = "{pki["ca"].cert}"\ncert = "{pki["ads"].cert}"\nkey = "{pki["ads"].key}"\n'
    )
    pin = fp(pki["bank"])
    path.write_text(
        body + f'[pins]\nbank = "{pin.upper().replace("SHA256", "sha256")}"\n'
        "[limits]\nfetches_per_peer = 3\nmessage_bytes = 5000\n[limits.kinds]\nshare_ = 700\n"
    )
    loaded = PartyConfig.load(path)
    assert loaded.pins == {"bank": pin} and loaded.limits.fetches_per_peer == 3
    assert loaded.caps.cap("share_train") == (700, "limits.kinds['share_']")
    assert loaded.caps.cap("residual") == (5000, "limits.message_bytes")
    assert loaded.caps.cap("public_key") == (1 << 20, "the kind table['public_key']")
    assert loaded.caps.cap("secagg_keys.0a1b2c") == (16 << 20, "the kind table['secagg_keys']")
    path.write_text(body + '[pins]\nbank = "md5:abc"\n')
    with pytest.raises(PartyConfigError, match=r"pins\.bank must be 'sha256:' and 64 hex"):
        PartyConfig.load(path)
    path.write_text(body + "[limits]\nfetches_per_pear = 3\n")
    with pytest.raises(PartyConfigError, match=r"unknown limits \['fetches_per_pear'\]"):
        PartyConfig.load(path)


def test_a_caller_whose_certificate_expired_learns_of_its_refusal_at_once(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    expired = certs.issue(
        pki["ca"],
        "ads",
        tmp_path / "expired",
        valid_from=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10),
        days=5,
    )
    bank_conf = config(pki, "bank", tmp_path)
    server, port = started(bank_conf)
    try:
        channel(bank_conf).endpoint("bank").send("ads", "x", 1)
        ads = replace(
            config(pki, "ads", tmp_path, {"bank": port}), cert=expired.cert, key=expired.key
        )
        begin = time.monotonic()
        with pytest.raises(ChannelError, match=r"refused this party's certificate in the TLS"):
            channel(ads).endpoint("ads").receive("bank", "x", timeout=60)
        assert time.monotonic() - begin < 5 and inbox(ads) == []
    finally:
        server.stop(None)


# ---- per-peer limits, per-kind caps -------------------------------------------------------


def _hold(conf: PartyConfig, port: int, key_fields: dict[str, object]) -> object:
    """A fetch whose stream is opened and then not read: it holds its slot at the endpoint."""
    transport = GrpcTransport(conf)
    stub = transport._channel("bank").unary_stream("/privreg.Messages/Fetch")
    stream = stub(codec.dumps({**key_fields, "wait": 0.0}), timeout=60)
    next(stream)  # the header: the server is now streaming (blocked on flow control)
    return stream


class _Poll(threading.Thread):
    """A fetch of a message not sent yet: the endpoint holds it (a long poll) up to 2 s."""

    def __init__(self, conf: PartyConfig, kind: str) -> None:
        super().__init__()
        self.key = channel(conf).key(0, "bank", "ads", kind)
        self.transport, self.error = GrpcTransport(conf), None

    def run(self) -> None:
        try:
            self.transport._fetch(self.key, time.monotonic() + 2.0)
        except Exception as error:
            self.error = error


def test_one_peer_beyond_its_limits_is_refused_while_another_is_served(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    limits = EndpointLimits(
        fetches_per_peer=3, long_polls_per_peer=1, bytes_in_flight_per_peer=50 << 20
    )
    bank_conf = replace(config(pki, "bank", tmp_path, {"ads": 1, "eve": 1}), limits=limits)
    assert limits.workers(len(bank_conf.peers)) == 3 * 3 + 4  # ads's share never all of them
    server, port = started(bank_conf)
    sender = channel(bank_conf).endpoint("bank")
    big = np.zeros(20 << 17)  # 20 MiB: far more than a connection's flow-control window
    for kind in ("a", "b", "c"):
        sender.send("ads", kind, big)
    sender.send("eve", "e", [1, 2, 3])
    ads = config(pki, "ads", tmp_path, {"bank": port})
    eve = config(pki, "eve", tmp_path, {"bank": port})
    fields = {"run": "job-1", "round": 0, "sender": "bank", "receiver": "ads"}

    def fetch(kind: str, wait: float = 0.0) -> None:
        GrpcTransport(ads)._fetch(channel(ads).key(0, "bank", "ads", kind), time.monotonic() + wait)

    held = [_hold(ads, port, {**fields, "kind": "a"})]
    try:
        poll = _Poll(ads, "later")
        poll.start()
        time.sleep(0.3)
        with pytest.raises(_RetryError, match=r"1 long polls held.*long_polls_per_peer = 1"):
            fetch("later2", wait=2.0)
        held.append(_hold(ads, port, {**fields, "kind": "c"}))
        with pytest.raises(_RetryError, match=r"has 3 fetches running.*fetches_per_peer = 3"):
            fetch("b")
        # meanwhile another peer is served at once
        begin = time.monotonic()
        assert channel(eve).endpoint("eve").receive("bank", "e", timeout=10) == [1, 2, 3]
        assert time.monotonic() - begin < 2
        poll.join()
        assert isinstance(poll.error, _NotYetError)
        # a third 20 MiB stream would put 60 MiB in flight to ads
        with pytest.raises(
            _RetryError, match=r"RESOURCE_EXHAUSTED.*bytes in flight.*bytes_in_flight_per_peer"
        ):
            fetch("b")
    finally:
        for stream in held:
            stream.cancel()  # type: ignore[attr-defined]
    try:  # the held streams ended: ads's share is back, its fetches are served again
        got = Channel(ads.root, "job-1", GrpcTransport(ads), timeout=10).endpoint("ads")
        assert got.receive("bank", "b", timeout=10).shape == big.shape
    finally:
        server.stop(None)


def test_a_stream_slower_than_its_time_limit_is_cancelled(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    limits = EndpointLimits(fetches_per_peer=1, long_polls_per_peer=1, stream_seconds=3.0)
    bank_conf = replace(config(pki, "bank", tmp_path), limits=limits)
    server, port = started(bank_conf)
    try:
        sender = channel(bank_conf).endpoint("bank")
        sender.send("ads", "a", np.zeros(40 << 17))
        sender.send("ads", "b", "small")
        ads = config(pki, "ads", tmp_path, {"bank": port})
        fields = {"run": "job-1", "round": 0, "sender": "bank", "receiver": "ads", "kind": "a"}
        stream = _hold(ads, port, fields)
        time.sleep(4.0)  # cancelled at 3 s (time to hash 42 MB on a busy machine): slot freed
        with pytest.raises(grpc.RpcError) as cancelled:
            for _ in stream:  # type: ignore[attr-defined]
                pass
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        assert channel(ads).endpoint("ads").receive("bank", "b", timeout=5) == "small"
    finally:
        server.stop(None)


def test_a_message_larger_than_its_kinds_cap_is_refused_before_it_is_written(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    bank_conf = config(pki, "bank", tmp_path)
    server, port = started(bank_conf)
    try:
        sender = channel(bank_conf).endpoint("bank")
        sender.send("ads", "public_key", b"k" * (2 << 20))  # a "key" of 2 MiB: cap 1 MiB
        sender.send("ads", "masked_gradient", np.zeros(1000))
        ads = config(pki, "ads", tmp_path, {"bank": port})
        with pytest.raises(
            ChannelError,
            match=r"'public_key' .*: 2097\d+ bytes exceed the cap of 1048576 for its kind "
            r"\(the kind table\['public_key'\]\); nothing written",
        ):
            channel(ads).endpoint("ads").receive("bank", "public_key", timeout=10)
        assert not ads.root.exists()  # not even a staging file or folder
        # a party may lower a kind's cap for itself
        strict = replace(ads, caps=MessageCaps(kinds={"masked_gradient": 4000}))
        with pytest.raises(ChannelError, match=r"limits.kinds\['masked_gradient'\]"):
            channel(strict).endpoint("ads").receive("bank", "masked_gradient", timeout=10)
        assert not ads.root.exists()
        got = channel(ads).endpoint("ads").receive("bank", "masked_gradient", timeout=10)
        assert got.shape == (1000,)
    finally:
        server.stop(None)


# ---- the endpoint checks itself -----------------------------------------------------------


def _party_toml(folder: Path, party: str, ca: Path, issued: certs.Issued) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "party.toml"
    path.write_text(
        f'party = "{party}"\nroot = "home"\nlisten = "127.0.0.1:0"\n[tls]\n'
        f'ca = "{ca}"\ncert = "{issued.cert}"\nkey = "{issued.key}"\n'
    )
    return path


def _serve_cli(config_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIVREG_")}
    env.update(PYTHONPATH=str(ROOT), GRPC_VERBOSITY="NONE")
    return subprocess.Popen(
        [sys.executable, "-m", "privreg.cli", "party", "serve", "--config", str(config_path)],
        cwd=config_path.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_party_serve_refuses_to_start_with_credentials_it_should_not_present(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    ca = pki["ca"]
    other_ca = certs.create_ca(tmp_path / "other-ca", name="other CA")
    foreign = certs.issue(other_ca, "bank", tmp_path / "foreign")
    expired = certs.issue(
        ca,
        "bank",
        tmp_path / "expired",
        valid_from=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=40),
        days=30,
    )
    readable = certs.issue(ca, "bank", tmp_path / "readable")
    readable.key.chmod(0o644)
    cases = {
        "foreign CA": (foreign, r"bank.pem: .* does not chain to this party.s CA"),
        "another party's": (pki["lab"], r"lab.pem is issued to 'lab', not to this party"),
        "expired": (expired, r"expired on \d{4}-\d\d-\d\d"),
        "world-readable key": (readable, r"bank.key is readable by group or others \(mode 0644\)"),
    }
    processes = {
        name: _serve_cli(_party_toml(tmp_path / name.replace(" ", "-"), "bank", ca.cert, issued))
        for name, (issued, _) in cases.items()
    }
    short = certs.issue(ca, "bank", tmp_path / "short", days=10)
    running = _serve_cli(_party_toml(tmp_path / "short", "bank", ca.cert, short))
    try:
        for name, process in processes.items():
            out, err = process.communicate(timeout=300)
            lines = err.strip().splitlines()
            assert process.returncode == 1 and out == "", (name, err)
            assert len(lines) == 1 and lines[0].startswith("privreg: error: refusing to serve: ")
            assert re.search(cases[name][1], lines[0]), (name, lines[0])
        # a good certificate: the endpoint starts, says who it is and warns of the expiry
        first = running.stdout.readline()  # type: ignore[union-attr]
        assert "party bank serving its messages on 127.0.0.1:" in first
        assert f"CN = DNS SAN = bank, {fp(short)}, expires " in first
        assert "in 10 days (WARNING: under 30 days)" in first
    finally:
        running.terminate()
        _, err = running.communicate(timeout=30)
    assert "WARNING: party bank's certificate expires in 10 days" in err


# ---- renewal ------------------------------------------------------------------------------


def _renew(ca: certs.Issued, party: str, into: certs.Issued, scratch: Path) -> certs.Issued:
    """A new certificate and key from the same CA, moved over the files a party uses."""
    fresh = certs.issue(ca, party, scratch)
    os.replace(fresh.cert, into.cert)
    os.replace(fresh.key, into.key)
    return into


def test_renewed_certificates_are_used_without_a_restart_or_a_failed_fetch(
    pki: dict[str, certs.Issued], tmp_path: Path
) -> None:
    ca = pki["ca"]
    live = {p: certs.issue(ca, p, tmp_path / "live") for p in ("bank", "ads")}
    renewed = {p: certs.issue(ca, p, tmp_path / f"renewed-{p}") for p in ("bank", "ads")}
    old = {p: fp(live[p]) for p in live}
    new = {p: fp(renewed[p]) for p in renewed}
    bank_conf = replace(config(pki, "bank", tmp_path), cert=live["bank"].cert, key=live["bank"].key)
    server, port = started(bank_conf)
    # lab accepts ads only with its renewed certificate
    lab_conf = replace(config(pki, "lab", tmp_path), pins={"ads": new["ads"]})
    lab, lab_port = started(lab_conf)
    channel(lab_conf).endpoint("lab").send("ads", "z", 7)
    ads = replace(
        config(pki, "ads", tmp_path, {"bank": port, "lab": lab_port}),
        cert=live["ads"].cert,
        key=live["ads"].key,
    )
    transport = GrpcTransport(ads)  # one transport for the whole job, as a party's process
    endpoint = Channel(ads.root, "job-1", transport, timeout=20).endpoint("ads")
    with pytest.raises(ChannelError, match="not the one pinned"):
        endpoint.receive("lab", "z")
    received: list[int] = []
    errors: list[BaseException] = []

    def loop() -> None:  # ads fetches one message after another, as a job's rounds do
        try:
            for k in range(40):
                received.append(endpoint.receive("bank", "step", round=k))
        except BaseException as error:
            errors.append(error)

    fetcher = threading.Thread(target=loop)
    fetcher.start()
    sender = channel(bank_conf).endpoint("bank")
    try:
        for k in range(40):
            sender.send("ads", "step", k, round=k)
            if k == 15:  # both renew mid-job: new files moved over the ones in use
                for party in ("bank", "ads"):
                    os.replace(renewed[party].cert, live[party].cert)
                    os.replace(renewed[party].key, live[party].key)
            time.sleep(0.05)
        fetcher.join(timeout=60)
        assert not errors and received == list(range(40))
        # new connections see the bank's renewed certificate
        sender.send("ads", "after", 1)
        fresh = replace(ads, root=tmp_path / "fresh", pins={"bank": new["bank"]})
        assert channel(fresh).endpoint("ads").receive("bank", "after", timeout=10) == 1
        stale = replace(ads, root=tmp_path / "stale", pins={"bank": old["bank"]})
        with pytest.raises(ChannelError, match="not the one pinned"):
            channel(stale).endpoint("ads").receive("bank", "after", timeout=10)
        # and ads's running transport presents its renewed one: lab now serves it
        assert endpoint.receive("lab", "z") == 7
    finally:
        fetcher.join(timeout=1)
        server.stop(None)
        lab.stop(None)
