"""SecretFlow's PSI (libpsi inside ``spu`` 0.9.5) timed on this machine, for bench_psi.

Run it with the python of the virtualenv that ``make peer-spu`` makes, never privreg's own:
spu brings about 440 MB of native libraries and jax, which privreg does not depend on.

Usage: python benchmarks/peers/spu_psi.py --size N [--protocol RR22 KKRT ECDH] [--repeats R]
                                          [--rank 0|1 --addresses HOST:PORT HOST:PORT]

Both parties hold N ids and share N / 2, the ids of ``id_sets.make_sets`` (``user-…``,
``a-only-…``, ``b-only-…``), written to one CSV file each. Each party is its own process with
its own link over loopback (libpsi's brpc link, no TLS), both learn the intersection
(``broadcast_result``) and both write it aligned (the same rows in the same order), as
privreg's parties do. A party's clock starts after its link is connected and both parties
passed a barrier, and stops when its aligned output is written; a run's seconds are the
slower party's. Prints one JSON document on stdout: per protocol the median seconds, each
run's seconds, both parties' CPU seconds (their threads and the ``sort`` commands libpsi runs)
and the larger peak resident memory.

With ``--rank`` it runs that party's side only, for bench_wan, which starts one such process
per party in each party's network namespace: ``--addresses`` gives party 0's and party 1's
link addresses as this side sees them (its own is where it listens, the peer's where it
dials, which may be a relay in between). Its JSON then holds this party's figures per
protocol and a SHA-256 of its aligned output, for the caller to compare with the peer's.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import multiprocessing
import os
import re
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from id_sets import party_ids  # this folder: the driver runs as a script from it

PROTOCOLS = ("RR22", "KKRT", "ECDH")
#: how libpsi's log names the small trace file it leaves after every run (outside TMPDIR)
TRACE = re.compile(r"Trace has been written to (\S+?)\.?$", re.MULTILINE)


def write_ids(path: Path, count: int, shared: int, prefix: str) -> None:
    """One party's ids (:func:`id_sets.party_ids`) in a one-column CSV file."""
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id"])
        writer.writerows([i] for i in party_ids(count, shared, prefix))


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _cpu() -> float:
    """User + system seconds of this process's threads and of the commands it ran and waited
    for (libpsi sorts its intersection files with the system's ``sort``)."""
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def party(rank: int, addresses: list[str], protocol: str, source: str, target: str, out) -> None:
    """One party's side: connect the link (``addresses``: each party's host:port), meet the
    peer, run the PSI, report to the parent. Its native log goes to ``target``.log, not to
    the benchmark's output."""
    log = os.open(f"{target}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from spu import libspu, psi

    desc = libspu.link.Desc()
    for index, address in enumerate(addresses):
        desc.add_party(f"party{index}", address)
    desc.recv_timeout_ms = 3_600_000
    desc.connect_retry_times = 120
    desc.connect_retry_interval_ms = 500
    link = libspu.link.create_brpc(desc, rank)
    config = psi.PsiExecuteConfig(
        protocol_conf=psi.PsiProtocolConfig(
            protocol=psi.parse_protocol(f"PROTOCOL_{protocol}"),
            receiver_rank=0,
            broadcast_result=True,
            ecdh_params=psi.EcdhParams(curve=psi.EllipticCurveType.CURVE_FOURQ),
        ),
        input_params=psi.InputParams(path=source, selected_keys=["id"], keys_unique=True),
        output_params=psi.OutputParams(path=target),
    )
    link.barrier()
    started = time.perf_counter()
    cpu = _cpu()
    report = psi.psi_execute(config, link)
    seconds = time.perf_counter() - started
    cpu = _cpu() - cpu
    link.stop_link()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((rank, seconds, cpu, peak, report.intersection_count))


def run_parties(
    protocol: str, folder: Path, addresses: list[str], ranks: tuple[int, ...]
) -> list[tuple]:
    """Run the parties of ``ranks`` (each its own process) to their end; their reports. On a
    failure their processes are killed and their logs' tails go to stderr."""
    for meta in folder.glob("*.meta"):  # libpsi's check of an input, cached beside it
        meta.unlink()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = [
        context.Process(
            target=party,
            args=(
                rank,
                addresses,
                protocol,
                str(folder / f"ids{rank}.csv"),
                str(folder / f"{protocol}-out{rank}.csv"),
                out,
            ),
        )
        for rank in ranks
    ]
    for process in processes:
        process.start()
    try:
        results = [out.get(timeout=3600) for _ in processes]
        for process in processes:
            process.join(timeout=60)
            if process.exitcode:
                raise SystemExit(f"spu {protocol} party failed (exit {process.exitcode})")
    except BaseException:
        for process in processes:
            process.kill()
        for log in folder.glob(f"{protocol}-out*.csv.log"):
            sys.stderr.write(f"--- {log.name}\n" + log.read_text()[-4000:])
        raise
    finally:
        for log in folder.glob(f"{protocol}-out*.csv.log"):
            for trace in TRACE.findall(log.read_text()):
                Path(trace).unlink(missing_ok=True)
    return results


def run_once(protocol: str, folder: Path) -> dict[str, float]:
    """Both parties over loopback."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    results = run_parties(protocol, folder, addresses, (0, 1))
    found = {r[4] for r in results}
    first, second = (folder / f"{protocol}-out{rank}.csv" for rank in range(2))
    if len(found) != 1 or first.read_bytes() != second.read_bytes():
        raise SystemExit(f"spu {protocol}: the parties' outputs differ ({found})")
    return {
        "seconds": max(r[1] for r in results),
        "cpu": sum(r[2] for r in results),
        "peak_mib": max(r[3] for r in results),
        "found": found.pop(),
    }


def run_side(protocol: str, folder: Path, rank: int, addresses: list[str]) -> dict[str, Any]:
    """One party's side only, its peer elsewhere: its figures and its output's digest."""
    ((_, seconds, cpu, peak, found),) = run_parties(protocol, folder, addresses, (rank,))
    output = (folder / f"{protocol}-out{rank}.csv").read_bytes()
    digest = hashlib.sha256(output).hexdigest()
    return {"seconds": seconds, "cpu": cpu, "peak_mib": peak, "found": found, "digest": digest}


def both_sides(protocols: list[str], folder: Path, size: int, repeats: int) -> dict[str, Any]:
    """Both parties over loopback, ``repeats`` runs per protocol: the figures per protocol."""
    shared = size // 2
    for rank, prefix in enumerate("ab"):
        write_ids(folder / f"ids{rank}.csv", size, shared, prefix)
    results = {}
    for protocol in protocols:
        runs = [run_once(protocol, folder) for _ in range(repeats)]
        if any(r["found"] != shared for r in runs):
            raise SystemExit(f"spu {protocol}: found {runs[0]['found']}, expected {shared}")
        results[protocol] = {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "runs": [r["seconds"] for r in runs],
            "cpu": statistics.median(r["cpu"] for r in runs),
            "peak_mib": max(r["peak_mib"] for r in runs),
            "found": shared,
        }
    return results


def one_side(
    protocols: list[str], folder: Path, size: int, rank: int, addresses: list[str]
) -> dict[str, Any]:
    """Party ``rank``'s side only, one run per protocol (a fresh link each)."""
    write_ids(folder / f"ids{rank}.csv", size, size // 2, "ab"[rank])
    return {protocol: run_side(protocol, folder, rank, addresses) for protocol in protocols}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000, help="ids of each party")
    parser.add_argument("--protocol", nargs="+", choices=PROTOCOLS, default=["RR22", "KKRT"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rank", type=int, choices=(0, 1), help="run this party's side only")
    parser.add_argument(
        "--addresses", nargs=2, metavar="HOST:PORT", help="with --rank: party 0's and 1's links"
    )
    args = parser.parse_args()
    if (args.rank is None) != (args.addresses is None):
        parser.error("--rank and --addresses go together")
    import spu.version

    document: dict[str, Any] = {"spu": spu.version.__version__, "size": args.size}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["TMPDIR"] = tmp  # libpsi's working files, removed with the folder
        if args.rank is None:
            results = both_sides(args.protocol, folder, args.size, args.repeats)
        else:
            results = one_side(args.protocol, folder, args.size, args.rank, args.addresses)
            document["rank"] = args.rank
    json.dump({**document, "protocols": results}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
