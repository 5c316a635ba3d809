"""SecretFlow's PSI (libpsi inside ``spu`` 0.9.5) timed on this machine, for bench_psi.

Run it with the python of the virtualenv that ``make peer-spu`` makes, never privreg's own:
spu brings about 440 MB of native libraries and jax, which privreg does not depend on.

Usage: python benchmarks/peers/spu_psi.py --size N [--protocol RR22 KKRT ECDH] [--repeats R]

Both parties hold N ids and share N / 2, the ids of ``id_sets.make_sets`` (``user-…``,
``a-only-…``, ``b-only-…``), written to one CSV file each. Each party is its own process with
its own link over loopback (libpsi's brpc link, no TLS), both learn the intersection
(``broadcast_result``) and both write it aligned (the same rows in the same order), as
privreg's parties do. A party's clock starts after its link is connected and both parties
passed a barrier, and stops when its aligned output is written; a run's seconds are the
slower party's. Prints one JSON document on stdout: per protocol the median seconds, each
run's seconds, both parties' CPU seconds (their threads and the ``sort`` commands libpsi runs)
and the larger peak resident memory.
"""

from __future__ import annotations

import argparse
import csv
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


def party(rank: int, ports: list[int], protocol: str, source: str, target: str, out) -> None:
    """One party's side: connect the link, meet the peer, run the PSI, report to the parent.
    Its native log goes to ``target``.log, not to the benchmark's output."""
    log = os.open(f"{target}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from spu import libspu, psi

    desc = libspu.link.Desc()
    for index, port in enumerate(ports):
        desc.add_party(f"party{index}", f"127.0.0.1:{port}")
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


def run_once(protocol: str, folder: Path) -> dict[str, float]:
    for meta in folder.glob("*.meta"):  # libpsi's check of an input, cached beside it
        meta.unlink()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ports = free_ports(2)
    processes = [
        context.Process(
            target=party,
            args=(
                rank,
                ports,
                protocol,
                str(folder / f"ids{rank}.csv"),
                str(folder / f"{protocol}-out{rank}.csv"),
                out,
            ),
        )
        for rank in range(2)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000, help="ids of each party")
    parser.add_argument("--protocol", nargs="+", choices=PROTOCOLS, default=["RR22", "KKRT"])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    import spu.version

    shared = args.size // 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["TMPDIR"] = tmp  # libpsi's working files, removed with the folder
        for rank, prefix in enumerate("ab"):
            write_ids(folder / f"ids{rank}.csv", args.size, shared, prefix)
        for protocol in args.protocol:
            runs = [run_once(protocol, folder) for _ in range(args.repeats)]
            if any(r["found"] != shared for r in runs):
                raise SystemExit(f"spu {protocol}: found {runs[0]['found']}, expected {shared}")
            results[protocol] = {
                "seconds": statistics.median(r["seconds"] for r in runs),
                "runs": [r["seconds"] for r in runs],
                "cpu": statistics.median(r["cpu"] for r in runs),
                "peak_mib": max(r["peak_mib"] for r in runs),
                "found": shared,
            }
    json.dump({"spu": spu.version.__version__, "size": args.size, "protocols": results}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
