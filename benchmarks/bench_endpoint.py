"""The party endpoint under one greedy peer, and what receiving a large message costs.

Usage: python benchmarks/bench_endpoint.py [--megabytes 256] [--fetches 40]

* **Starvation.** A greedy peer keeps 24 fetches of messages never sent (long polls) open
  at the bank's endpoint while another peer fetches ``--fetches`` small messages one after
  another; the other peer's seconds per fetch are printed with the endpoint as it was before
  per-peer limits (8 workers, no per-peer caps) and as it is now (defaults).
* **Receiving.** A message of ``--megabytes`` (one float64 array) is fetched, then decoded
  the old way (the file read back whole into memory, then decoded) and the new way (decoded
  from a read-only map of the file); each in a fresh process, sampling its anonymous memory
  (RssAnon: the heap, not the page cache) every 2 ms.
* **Per-message cost** of the sender's proof: signing and checking one header.

Everything runs on loopback with a throw-away CA; the machine's other load inflates the
times, not the ratio of memory.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation import certs
from federation.channel import Channel
from federation.endpoint_limits import EndpointLimits
from federation.identity import check_own, check_sender, sign, statement
from federation.party_config import PartyConfig
from federation.transport_grpc import GrpcTransport, serve

PARTIES = ("bank", "ads", "greedy")


def _configs(root: Path) -> dict[str, PartyConfig]:
    ca = certs.create_ca(root / "ca")
    issued = {p: certs.issue(ca, p, root / "certs") for p in PARTIES}
    return {
        p: PartyConfig(p, root / p, "127.0.0.1:0", ca.cert, issued[p].cert, issued[p].key)
        for p in PARTIES
    }


def _with_bank(conf: PartyConfig, port: int) -> PartyConfig:
    return replace(conf, peers={"bank": f"127.0.0.1:{port}"})


def starvation(confs: dict[str, PartyConfig], fetches: int) -> list[tuple[str, float, float]]:
    """The other peer's seconds per fetch while the greedy one holds long polls."""
    rows = []
    old = EndpointLimits(fetches_per_peer=10**6, long_polls_per_peer=10**6)
    cases = (
        ("before: 8 workers, no per-peer caps", old, 8),
        ("now: the defaults", EndpointLimits(), None),
    )
    for label, limits, workers in cases:
        bank = replace(confs["bank"], limits=limits, peers={"ads": "-", "greedy": "-"})
        server, port = serve(bank, max_workers=workers)
        sender = Channel(bank.root, f"starve-{port}", GrpcTransport(bank)).endpoint("bank")
        for k in range(fetches):
            sender.send("ads", "small", k, round=k)
        stop = threading.Event()

        def greedy(index: int, port: int = port, stop: threading.Event = stop) -> None:
            transport = GrpcTransport(_with_bank(confs["greedy"], port))
            channel = Channel(transport.folder.root, f"starve-{port}", transport)
            key = channel.key(index, "bank", "greedy", "never")
            while not stop.is_set():
                with contextlib.suppress(Exception):  # refused or not sent: ask again
                    transport._fetch(key, time.monotonic() + 2.0)

        hogs = [threading.Thread(target=greedy, args=(i,), daemon=True) for i in range(24)]
        for hog in hogs:
            hog.start()
        time.sleep(1.0)
        ads = _with_bank(replace(confs["ads"], root=confs["ads"].root / str(port)), port)
        endpoint = Channel(ads.root, f"starve-{port}", GrpcTransport(ads), timeout=60)
        times = []
        for k in range(fetches):
            begin = time.monotonic()
            endpoint.endpoint("ads").receive("bank", "small", round=k)
            times.append(time.monotonic() - begin)
        stop.set()
        for hog in hogs:
            hog.join()
        server.stop(None)
        rows.append((label, statistics.median(times), max(times)))
    return rows


_CHILD = """
import sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from storage import codec
from federation.transport_grpc import _mapped
path, mode = Path(sys.argv[2]), sys.argv[3]
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak, base, done = [0], anon(), threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon()); time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
value = codec.loads(path.read_bytes() if mode == "bytes" else _mapped(path))
peak[0] = max(peak[0], anon()); done.set()
print((peak[0] - base) / 2**20, value.nbytes / 2**20)
"""


def receiving(
    confs: dict[str, PartyConfig], megabytes: int
) -> tuple[list[tuple[str, float, float]], float]:
    bank = confs["bank"]
    server, port = serve(bank)
    try:
        vector = np.random.default_rng(1).random(megabytes * 2**20 // 8)
        Channel(bank.root, "big", GrpcTransport(bank)).endpoint("bank").send("ads", "x", vector)
        del vector
        ads = _with_bank(confs["ads"], port)
        transport = GrpcTransport(ads)
        channel = Channel(ads.root, "big", transport, timeout=300)
        key = channel.key(0, "bank", "ads", "x")
        begin = time.monotonic()
        transport.get(key, 300)  # fetched and stored; the decode is measured below
        fetched = time.monotonic() - begin
    finally:
        server.stop(None)
    root = str(Path(__file__).resolve().parents[1])
    rows = []
    modes = (
        ("read back whole, then decoded (before)", "bytes"),
        ("decoded from a map of the file (now)", "map"),
    )
    for label, mode in modes:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, root, str(transport.folder.path(key)), mode],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        rows.append((label, float(out[0]), float(out[1])))
    return rows, fetched


def proof_cost(confs: dict[str, PartyConfig], repeats: int = 300) -> tuple[float, float]:
    c = confs["bank"]
    own = check_own(c.party, c.ca, c.cert, c.key)
    fields = {"run": "j", "round": 0, "sender": "bank", "receiver": "ads", "kind": "x"}
    data = statement(fields, 10, "0" * 64)
    begin = time.perf_counter()
    for _ in range(repeats):
        signature = sign(own, data)
    signing = (time.perf_counter() - begin) / repeats
    ca = c.ca.read_bytes()
    begin = time.perf_counter()
    for _ in range(repeats):
        check_sender("bank", own.chain_pem, signature, data, ca, {})
    return signing, (time.perf_counter() - begin) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--fetches", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-endpoint-") as folder:
        confs = _configs(Path(folder))
        print("| another peer's fetch while one peer holds 24 long polls | median s | max s |")
        print("|---|---|---|")
        for label, median, worst in starvation(confs, args.fetches):
            print(f"| {label} | {median:.3f} | {worst:.3f} |")
        print("\n| receiving one message | peak heap growth MiB | decoded value MiB |")
        print("|---|---|---|")
        rows, fetched = receiving(confs, args.megabytes)
        for label, peak, value in rows:
            print(f"| {label} | {peak:.1f} | {value:.1f} |")
        print(f"\nfetching and storing it took {fetched:.2f} s")
        signing, checking = proof_cost(confs)
        print("\n| sender's proof, per message | microseconds |\n|---|---|")
        print(
            f"| sign (sender) | {signing * 1e6:.0f} |\n| check (receiver) | {checking * 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
