"""Vertical LR over the network beside the one-process file channel, in the same run.

Usage: python benchmarks/bench_network.py [--rows 30000] [--key-size 2048] [--batch-size 4096]

Data: FATE's default_credit hetero split (30,000 rows; the guest holds the labels and 13
features, the host 10), one epoch, the settings ``bench_vertical`` uses (batch 4,096, clip 3).

* file channel: the one-process ``vertical_lr`` (every party in this process, messages through
  one folder);
* gRPC: the guest, the host and the arbiter each their own OS process at its own folder,
  database, certificate and Prefect home (``privreg party vertical``), each with its message
  endpoint (``privreg party serve``), over mutual TLS on loopback. Every connection a party
  opens to a peer passes a byte counter here, so "on the wire" is what crossed TCP (TLS
  records, HTTP/2 frames, requests and handshakes), beside the payload (the encoded messages
  the party received).

Wall seconds per epoch: key generation, set-up, the rounds, the hold-out loss and scoring, from
the moment every party's flow runs to the last one's end (process start-up and imports
excluded; the span from the first party's start is printed too); the one-process run is timed
around the flow call. Both runs must end with the same
model, which is checked. The machine's other load inflates both; the ratio is what matters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from core.paillier.keys import MIN_SECURE_KEY_BITS, SMALL_KEYS_VARIABLE, small_keys_allowed
from demo.orgs import Org, free_port, make_orgs, serve, start
from federation.channel import Channel
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore

DATA = Path(__file__).resolve().parent / "data" / "fate"
PARTIES = ("guest", "host", "arbiter")


class Counter:
    """A TCP relay from ``listen`` to ``target`` that counts the bytes in each direction."""

    def __init__(self, target: int) -> None:
        self.target, self.port = target, free_port()
        self.down = self.up = 0  # down: from the peer's endpoint to the party that dialled
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.sock.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for source, sink, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(source, sink, down), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, down: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
                with self.lock:
                    if down:
                        self.down += len(data)
                    else:
                        self.up += len(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)


def credit(rows: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    guest = pd.read_csv(DATA / "default_credit_hetero_guest.csv.gz").head(rows)
    host = pd.read_csv(DATA / "default_credit_hetero_host.csv.gz").set_index("id")
    return guest, host.loc[guest["id"]].reset_index()


def tables(folder: Path, rows: int, guest: str = "guest", host: str = "host") -> list[TableRef]:
    guest_frame, host_frame = credit(rows)
    refs = [
        TableRef(str(folder / guest / f"{guest}.duckdb"), "credit", label_column="y"),
        TableRef(str(folder / host / f"{host}.duckdb"), "credit"),
    ]
    for ref, frame in zip(refs, (guest_frame, host_frame), strict=True):
        PartyStore.of(ref).import_frame(frame, ref)
    return refs


def payload_received(channel: Channel, party: str) -> int:
    return sum(r.size for r in channel.log() if r.receiver == party)


def file_channel(folder: Path, rows: int, options: dict[str, Any]) -> dict[str, Any]:
    from flows.vertical_lr import vertical_lr

    guest, host = tables(folder, rows)
    started = time.perf_counter()
    result = vertical_lr(guest.to_dict(), [host.to_dict()], workspace=str(folder), **options)
    seconds = time.perf_counter() - started
    channel = Channel(folder, result["job_id"])
    model = ArtifactStore(PartyStore.of(host)).get(f"models/vertical/{result['job_id']}/host")
    return {
        "seconds": seconds,
        "payload": {p: payload_received(channel, p) for p in PARTIES},
        "model": (result["intercept"], result["coefficients"], model["coefficients"]),
    }


def grpc_parties(folder: Path, rows: int, options: dict[str, Any], api: str) -> dict[str, Any]:
    counters: dict[tuple[str, str], Counter] = {}
    real_ports: dict[str, int] = {}

    def route(party: str, peer: str) -> int:  # the port is bound when the relay starts below
        counters[party, peer] = Counter(0)
        return counters[party, peer].port

    orgs = make_orgs(folder, list(PARTIES), receive_timeout=3600, route=route)
    for org in orgs.values():
        real_ports[org.party] = org.port
    for (_, peer), counter in counters.items():
        counter.target = real_ports[peer]
    refs = dict(zip(("guest", "host"), tables(folder, rows), strict=True))
    extra = {"PREFECT_API_URL": api}
    if small_keys_allowed():  # each party process's own opt-in, as this process's
        extra[SMALL_KEYS_VARIABLE] = "1"
    servers = [serve(org, extra) for org in orgs.values()]
    runs: dict[str, Any] = {}
    try:
        for party, org in orgs.items():
            args = ["--job", "bench-network", "--role", party, "--guest", "guest", "--hosts"]
            args += ["host", "--options", json.dumps(options)]
            if party in refs:
                args += ["--table", json.dumps(refs[party].to_dict())]
            runs[party] = start(org, "vertical", args, extra, stderr=open(org.folder / "log", "w"))  # noqa: SIM115
        results = {}
        for party, run in runs.items():
            out, _ = run.communicate(timeout=7200)
            if run.returncode:
                tail = (orgs[party].folder / "log").read_text()[-3000:]
                raise SystemExit(f"{party} failed (exit {run.returncode}):\n{tail}")
            results[party] = json.loads(out.strip().splitlines()[-1])
    finally:
        for process in [*runs.values(), *servers]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
    model = ArtifactStore(PartyStore.of(refs["host"])).get(results["host"]["model_key"])
    guest = results["guest"]
    return {
        # from the moment every party's flow runs (their process starts are staggered by
        # imports), and from the first party's start, to the last party's end
        "seconds": max(r["finished_at"] for r in results.values())
        - max(r["started_at"] for r in results.values()),
        "span": max(r["finished_at"] for r in results.values())
        - min(r["started_at"] for r in results.values()),
        "payload": {p: received(orgs[p], p) for p in PARTIES},
        "wire": {p: sum(c.down for (who, _), c in counters.items() if who == p) for p in PARTIES},
        "requests": {p: sum(c.up for (who, _), c in counters.items() if who == p) for p in PARTIES},
        "model": (guest["intercept"], guest["coefficients"], model["coefficients"]),
    }


def received(org: Org, party: str) -> int:
    channel = Channel(org.folder / "home", "bench-network")
    return payload_received(channel, party)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=30_000)
    parser.add_argument("--key-size", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4096)
    args = parser.parse_args()
    if args.key_size < MIN_SECURE_KEY_BITS:
        os.environ[SMALL_KEYS_VARIABLE] = "1"  # a benchmark's opt-in to a smaller key
    options = {
        "epochs": 1,
        "batch_size": args.batch_size,
        "learning_rate": 0.5,
        "momentum": 0.9,
        "clip_features": 3.0,
        "key_size": args.key_size,
        "tol": 0.0,
    }
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=180):
        api = str(PREFECT_API_URL.value())
        network = grpc_parties(Path(tmp) / "grpc", args.rows, options, api)
        files = file_channel(Path(tmp) / "files", args.rows, options)
    same = network["model"] == files["model"]
    print(
        f"\n### Vertical LR, one epoch: default_credit {args.rows:,} rows (13 + 10 features), "
        f"{args.key_size}-bit, batch {args.batch_size:,}, guest + host + arbiter\n"
    )
    print("| channel | wall s / epoch | vs file channel |")
    print("|---|---:|---:|")
    print(f"| one process, file channel | {files['seconds']:.1f} | 1.00 |")
    ratio = network["seconds"] / files["seconds"]
    print(f"| three processes, mTLS gRPC | {network['seconds']:.1f} | {ratio:.2f} |")
    span = network["span"]
    print(
        f"| the same, from the first party's start | {span:.1f} | {span / files['seconds']:.2f} |"
    )
    print(
        "\n| party | payload received (bytes) | on the wire to it | wire / payload "
        "| its requests | payload, file channel |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for party in PARTIES:
        payload, wire = network["payload"][party], network["wire"][party]
        print(
            f"| {party} | {payload:,} | {wire:,} | {wire / max(payload, 1):.4f} "
            f"| {network['requests'][party]:,} | {files['payload'][party]:,} |"
        )
    print(f"\nsame model in both runs (bit for bit): {same}")


if __name__ == "__main__":
    main()
