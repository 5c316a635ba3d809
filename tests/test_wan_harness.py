"""The WAN harness (benchmarks/wan.py): its relay delays, its tbf caps, its cleanup is whole.

Needs root and ``ip netns``; skipped with the reason elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import wan

pytestmark = pytest.mark.skipif(bool(wan.available()), reason=str(wan.available()))

ECHO = """
import socket
server = socket.create_server(({host!r}, {port}))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    while data := conn.recv(65536):
        conn.sendall(data[-1:])
    conn.close()
"""

PROBE = """
import socket, time
conn = socket.create_connection(({host!r}, {port}))
rtts = []
for _ in range(5):
    started = time.monotonic()
    conn.sendall(b"x")
    conn.recv(1)
    rtts.append(time.monotonic() - started)
print(min(rtts))
payload, sent = b"y" * 65536, 0
started = time.monotonic()
while sent < {size}:
    conn.sendall(payload)
    sent += len(payload)
conn.shutdown(socket.SHUT_WR)
while conn.recv(65536):
    pass
print(sent * 8 / (time.monotonic() - started) / 1e6)
"""


def probe(setting: wan.Setting, size: int) -> tuple[float, float, dict[str, dict[str, int]]]:
    """Min RTT (s) and throughput (Mbit/s) from a to b's echo server through the relay."""
    with wan.Wan(["a", "b"], setting) as net:
        echo = ECHO.format(host=net.address["b"], port=wan.ENDPOINT_PORT)
        server = net.popen("b", [sys.executable, "-c", echo], stdout=subprocess.PIPE, text=True)
        assert server.stdout and server.stdout.readline().strip() == "listening"
        host, port = net.peer_address("a", "b").split(":")
        code = PROBE.format(host=host, port=int(port), size=size)
        client = net.popen("a", [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        out, _ = client.communicate(timeout=60)
        rtt, mbit = (float(line) for line in out.split())
        return rtt, mbit, net.wire()


def test_relay_delays_tbf_caps_and_cleanup_is_whole() -> None:
    rtt, mbit, wire = probe(wan.Setting("test", 40, 60), size=4_000_000)
    assert rtt >= 0.060  # twice the one-way delay, at least
    assert rtt < 0.060 + 0.05
    assert 40 * 0.6 < mbit < 40 * 1.15  # tbf at 40 Mbit/s (the delay's tail costs a little)
    assert wire["a"]["sent"] >= 4_000_000 and wire["b"]["received"] == wire["a"]["sent"]
    assert wire["a"]["turns"] >= 5
    assert wan.harness_namespaces(f"{wan.PREFIX}{os.getpid()}-") == []  # this process's


ONE_ECHO = """
import socket
try:
    with socket.create_connection(({host!r}, {port}), timeout=1) as conn:
        conn.sendall(b"x")
        print("echo" if conn.recv(1) == b"x" else "closed")
except OSError as error:
    print(type(error).__name__)
"""


def test_a_cut_link_stops_traffic_until_restored() -> None:
    with wan.Wan(["a", "b"], wan.Setting("test", 100, 2)) as net:
        echo = ECHO.format(host=net.address["b"], port=wan.ENDPOINT_PORT)
        server = net.popen("b", [sys.executable, "-c", echo], stdout=subprocess.PIPE, text=True)
        assert server.stdout and server.stdout.readline().strip() == "listening"
        host, port = net.peer_address("a", "b").split(":")
        code = ONE_ECHO.format(host=host, port=int(port))

        def once() -> str:
            client = net.popen("a", [sys.executable, "-c", code], stdout=subprocess.PIPE)
            return client.communicate(timeout=10)[0].decode().strip()

        assert once() == "echo"
        net.cut("a")
        assert once() != "echo"
        net.restore("a")
        assert once() == "echo"
        net.drop("b")  # the relay refuses connections to b's endpoint: closed, or reset
        assert once() in ("closed", "ConnectionResetError")  # if the close races the send
        net.restore("b")
        assert once() == "echo"


def _messages(org_folder, job: str, timeline: list[tuple[str, str]]) -> None:
    """``timeline``'s messages (round folder, sender__receiver__kind) written in its order."""
    for i, (round_folder, name) in enumerate(timeline):
        path = org_folder / "home" / "runs" / job / "messages" / round_folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (1000.0 + i, 1000.0 + i))


def test_round_trips_are_counted_from_the_messages_and_a_zero_prints_0(tmp_path) -> None:
    from benchmarks import bench_wan
    from demo.orgs import Org

    orgs = {p: Org(p, tmp_path / p, tmp_path / p / "party.toml", 0) for p in ("lab", "clinic")}
    _messages(tmp_path / "lab", "j", [
        ("r000000", "lab__clinic__digest"), ("r000000", "clinic__lab__plan"),
        ("r000000", "lab__clinic__sums"), ("r000000", "clinic__lab__release"),
    ])  # fmt: skip
    _messages(tmp_path / "clinic", "j", [
        ("r000000", "lab__clinic__digest"), ("r000000", "clinic__lab__plan"),
        ("r000000", "lab__clinic__sums"), ("r000001", "clinic__lab__release"),
    ])  # fmt: skip
    assert bench_wan.job_round_trips(orgs, "j") == 2  # the lab waits twice, the clinic once
    assert bench_wan.coordinator_round_trips(orgs["lab"], "j") == 2  # one folder
    assert bench_wan.coordinator_round_trips(orgs["clinic"], "j") == 0.5  # median of 1 and 0
    _messages(tmp_path / "lab", "k", [("r000000", "lab__clinic__release")])
    _messages(tmp_path / "clinic", "k", [("r000000", "lab__clinic__release")])
    assert bench_wan.job_round_trips(orgs, "k") == 0
    figures = {"seconds": 1.0, "wire": {"lab": 0}, "round trips": 1, "messages": 1,
               "most sent": 0, "network share": 0.0}  # fmt: skip
    measured = bench_wan.row("x", wan.LAN, {**figures, "message round trips": 0}, None, 1)
    unmeasured = bench_wan.row("x", wan.LAN, {**figures, "message round trips": None}, None, 1)
    assert measured.split(" | ")[7:9] == ["0", "1"]
    assert unmeasured.split(" | ")[7:9] == ["-", "1"]
    runs = [{**figures, "message round trips": 0}, figures]  # one run did not count them
    assert bench_wan.median_of(runs)["message round trips"] is None


def test_the_credit_epoch_prints_its_wan_seconds_against_the_target_multiple() -> None:
    from benchmarks import bench_wan

    lan = {"seconds": 20.0, "wire": {"lab": 0}, "round trips": 1, "messages": 1,
           "most sent": 0, "network share": 0.0, "message round trips": None}  # fmt: skip
    met = bench_wan.row(bench_wan.CREDIT, wan.WAN, {**lan, "seconds": 25.0}, lan, 1)
    missed = bench_wan.row(bench_wan.CREDIT, wan.WAN, {**lan, "seconds": 27.0}, lan, 1)
    assert "1.25x LAN, target ≤ 1.3x: met" in met
    assert "1.35x LAN, target ≤ 1.3x: missed" in missed
    far = bench_wan.row(bench_wan.CREDIT, wan.FAR_WAN, {**lan, "seconds": 40.0}, lan, 1)
    other = bench_wan.row("vertical LR demo, 4 rounds", wan.WAN, {**lan, "seconds": 40.0}, lan, 1)
    assert "target" not in far and "target" not in other  # the target is the WAN's, this job's
