"""PSI throughput and memory: privreg's KKRT16 OT-extension protocol (the default) and its X25519
ECDH protocol beside openmined-psi, in the same run.

Usage: python benchmarks/bench_psi.py [--size N] [--small M] [--repeats R] [--no-baseline]
                                      [--no-ecdh] [--bucket-ids B]

Party ``a`` has M ids (default N), party ``b`` N ids; they share M / 2. "ids/s" counts both sets
per second of the whole protocol, as openmined-psi's published figure does.

* privreg KKRT16: each party is its own OS process (spawned, so it inherits no memory) with its
  own DuckDB store holding an ``ids`` table; it runs its side exactly as ``psi_align_party``
  does (the same steps, called directly rather than as Prefect task runs): stream the ids out
  of DuckDB into buckets, exchange the messages over privreg's channel (the file transport in
  a temporary folder: the same code path as one process or mTLS, without the network), write
  the aligned table. The time runs from the start of both processes to both aligned tables;
  each side's digest of its aligned table (ids and row order) must be equal. Per party: CPU
  seconds (its process and its hashing pool), peak resident memory, bytes sent and received
  as the channel stored them.
* privreg X25519 ECDH: both parties' steps in this process, from the ids in memory.
* openmined-psi: client and server in this process, 1e-9 false-positive rate, raw data
  structure (exact), the client learns only.

"cpu s" is user + system time of all processes; peak MiB is the largest resident set of one
party process (KKRT) or of this process and its children (ECDH, openmined-psi).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from core import psi
from core.psi_ot import buckets, cuckoo, kkrt
from core.psi_ot import protocol as kkrt_psi

#: KKRT16 at n = 2^20 as reported in Raghuraman and Rindal, "Blazing Fast PSI from Improved
#: OKVS and Subfield VOLE" (CCS 2022), Table 2, for the authors' implementation on one
#: thread: 1008 bits per id and 2,073 ms; RR22 itself: 251 bits (fast) or 180 (low comm.).
KKRT16_REPORTED_BITS, KKRT16_REPORTED_MS, RR22_REPORTED_BITS = 1008, 2073, 180
#: SecretFlow's libpsi (``spu`` 0.9.5 from PyPI) on this two-core machine, two processes over
#: loopback, both learn, 50% overlap: wall seconds at 100k x 100k and 1M x 1M as measured by an
#: earlier session; printed as reported, not rerun (installing spu brings ~440 MB and jax).
SPU_REPORTED = {
    "RR22 (VOLE-based OPRF)": (0.78, 8.3),
    "KKRT16 (OT-based OPRF)": (1.42, 12.5),
    "ECDH on FourQ": (7.3, 64.0),
}


def make_sets(small: int, size: int) -> tuple[list[str], list[str]]:
    shared = [f"user-{i:09d}" for i in range(small // 2)]
    a = shared + [f"a-only-{i:09d}" for i in range(small - len(shared))]
    b = shared + [f"b-only-{i:09d}" for i in range(size - len(shared))]
    return a, b


def _sql_ids(count: int, shared: int, prefix: str) -> str:
    """The ids of ``make_sets`` generated inside DuckDB (no Python list to inherit or copy)."""
    return (
        f"SELECT CASE WHEN i < {shared} THEN 'user-' || lpad(i::VARCHAR, 9, '0') "
        f"ELSE '{prefix}-only-' || lpad((i - {shared})::VARCHAR, 9, '0') END AS id "
        f"FROM range({count}) t(i)"
    )


@dataclass
class Party:
    name: str
    receiver: bool
    ids: int
    cpu: float
    peak_mib: float
    sent: int
    received: int


@dataclass
class Run:
    seconds: float
    found: int
    cpu: float
    peak_mib: float
    wire_bytes: int = 0
    parties: list[Party] = field(default_factory=list)
    idle_mib: float = 0.0  # a party process with its modules imported, before it starts


def _cpu() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _peak_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def _kkrt_party(party: str, peer: str, database: str, root: str, out, go) -> None:
    """One party's whole side, as ``psi_align_party`` runs it (steps called directly); its
    clock and CPU count start once its modules are imported and both parties are ready."""
    from prefect.logging import disable_run_logger

    from storage.descriptor import TableRef
    from storage.party_store import PartyStore
    from storage.workspace import channel_for
    from tasks import psi_kkrt

    ref = TableRef(database, "ids", party=party)
    out.put(("ready", _peak_mib()))
    go.wait()
    start = _cpu()
    with disable_run_logger():
        summary = psi_kkrt.party_side(
            ref, peer, "bench", 1, root, call=lambda step, *args: step.fn(*args)
        )
    cpu, peak = _cpu() - start, _peak_mib()
    with PartyStore(database).connect() as con:
        order = con.execute(
            f"SELECT count(*), sum(hash(rowid::VARCHAR || ':' || id) % 1000000007) FROM \"{summary['table']}\""  # noqa: E501
        ).fetchone()
    totals = channel_for("bench", root).bytes_by_party().get(party, {"sent": 0, "received": 0})
    receiver = summary["own_size"] < summary["peer_size"] or (
        summary["own_size"] == summary["peer_size"] and party < peer
    )
    out.put((party, receiver, summary["own_size"], order, cpu, peak, totals))


def run_kkrt(small: int, size: int) -> Run:
    import duckdb

    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited memory
    with tempfile.TemporaryDirectory() as root:
        databases = {}
        for party, count, prefix in (("a", small, "a"), ("b", size, "b")):
            databases[party] = str(Path(root) / f"{party}.duckdb")
            with duckdb.connect(databases[party]) as con:
                con.execute(f"CREATE TABLE ids AS {_sql_ids(count, small // 2, prefix)}")
        out, go = context.Queue(), context.Event()
        processes = [
            context.Process(target=_kkrt_party, args=(p, q, databases[p], root, out, go))
            for p, q in (("a", "b"), ("b", "a"))
        ]
        for process in processes:
            process.start()
        idle = max(out.get()[1] for _ in processes)  # both imported and waiting
        started = time.perf_counter()
        go.set()
        reports = [out.get() for _ in processes]
        seconds = time.perf_counter() - started
        for process in processes:
            process.join()
            assert process.exitcode == 0
    orders = {report[3] for report in reports}
    assert len(orders) == 1, "the two sides' aligned rows differ"
    parties = [
        Party(name, receiver, ids, cpu, peak, totals["sent"], totals["received"])
        for name, receiver, ids, _, cpu, peak, totals in sorted(reports)
    ]
    found = int(reports[0][3][0])
    return Run(
        seconds,
        found,
        sum(p.cpu for p in parties),
        max(p.peak_mib for p in parties),
        sum(p.sent for p in parties),
        parties,
        idle,
    )


def run_ecdh(small: int, size: int) -> Run:
    a, b = make_sets(small, size)
    started, cpu = time.perf_counter(), _cpu()
    key_a, key_b = psi.new_key(), psi.new_key()
    sent_a, sent_b = psi.prepare(a, key_a), psi.prepare(b, key_b)
    a_double = psi.reblind(sent_a.blinded, key_b)
    b_double = psi.reblind(sent_b.blinded, key_a)
    result_a = psi.intersect(a_double, sent_a.rows, b_double)
    result_b = psi.intersect(b_double, sent_b.rows, a_double)
    assert result_a.size == result_b.size
    wire = 2 * (len(a) + len(b)) * psi.POINT_BYTES
    return Run(time.perf_counter() - started, result_a.size, _cpu() - cpu, _peak_mib(), wire)


def run_openmined(small: int, size: int) -> Run:
    import private_set_intersection.python as om

    a, b = make_sets(small, size)
    started, cpu = time.perf_counter(), _cpu()
    client = om.client.CreateWithNewKey(True)
    server = om.server.CreateWithNewKey(True)
    setup = server.CreateSetupMessage(1e-9, len(a), b, om.DataStructure.RAW)
    request = client.CreateRequest(a)
    response = server.ProcessRequest(request)
    found = len(client.GetIntersection(setup, response))
    wire = sum(len(m.SerializeToString()) for m in (setup, request, response))
    return Run(time.perf_counter() - started, found, _cpu() - cpu, _peak_mib(), wire)


def kkrt_formula_bytes(receiver: int, sender: int) -> int:
    """KKRT16's communication by construction in one bucket: the OT-extension matrix (``k`` =
    512 bits per cuckoo bin of the receiver) and three truncated OPRF values per sender id."""
    bins = cuckoo.table_size(receiver)
    return bins * kkrt.WIDTH // 8 + 3 * sender * kkrt_psi.output_bytes(bins, sender)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=100_000, help="ids of the larger party")
    parser.add_argument("--small", type=int, help="ids of the other party (default: --size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip openmined-psi")
    parser.add_argument("--no-ecdh", action="store_true", help="skip privreg's ECDH")
    parser.add_argument("--bucket-ids", type=int, help="KKRT ids per bucket (default: privreg's)")
    args = parser.parse_args()
    n, small = args.size, args.small or args.size
    os.environ.setdefault("PRIVREG_RECEIVE_TIMEOUT", "7200")  # the party processes wait this long
    if args.bucket_ids:
        os.environ["PRIVREG_PSI_BUCKET_IDS"] = str(args.bucket_ids)
    runners = {"privreg KKRT16, 2 party processes over the channel (both learn)": run_kkrt}
    if not args.no_ecdh:
        runners["privreg X25519 ECDH, one process (both learn)"] = run_ecdh
    if not args.no_baseline:
        runners["openmined-psi 2.x P-256 (client learns)"] = run_openmined
    runs: dict[str, list[Run]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            outcome = run(small, n)
            assert outcome.found == small // 2, (name, outcome.found)
            runs[name].append(outcome)
    print(f"\n### PSI, {small:,} x {n:,} ids, {small // 2:,} shared, median of {args.repeats}\n")
    print("| implementation | median s | ids/s | cpu s | peak MiB | wire bytes/id |")
    print("|---|---|---|---|---|---|")
    for name, samples in runs.items():
        median = statistics.median(r.seconds for r in samples)
        cpu = statistics.median(r.cpu for r in samples)
        peak = max(r.peak_mib for r in samples)
        wire = samples[0].wire_bytes / n
        print(
            f"| {name} | {median:.2f} | {(small + n) / median:,.0f} | {cpu:.1f} | {peak:,.0f} "
            f"| {wire:.1f} |"
        )
    column = {100_000: 0, 1_000_000: 1}.get(n) if small == n else None
    for name, figures in SPU_REPORTED.items() if column is not None else ():
        print(
            f"| spu 0.9.5 {name}: reported (measured by an earlier session), not rerun "
            f"| {figures[column]:.2f} | {2 * n / figures[column]:,.0f} | | | |"
        )
    kkrt_runs = next(iter(runs.values()))
    idle = max(r.idle_mib for r in kkrt_runs)
    print(
        "\nprivreg KKRT16 per party (median over runs; bytes as the channel stored them; a "
        f"party process holds {idle:,.0f} MiB with its modules imported, before it starts):\n"
    )
    print("| party | role | ids | cpu s | peak MiB | MB sent | MB received |")
    print("|---|---|---|---|---|---|---|")
    for index, party in enumerate(kkrt_runs[0].parties):
        samples = [r.parties[index] for r in kkrt_runs]
        print(
            f"| {party.name} | {'receiver' if party.receiver else 'sender'} | {party.ids:,} "
            f"| {statistics.median(p.cpu for p in samples):.1f} "
            f"| {max(p.peak_mib for p in samples):,.0f} | {party.sent / 1e6:.1f} "
            f"| {party.received / 1e6:.1f} |"
        )
    bucket_ids = args.bucket_ids or buckets.BUCKET_IDS
    count = buckets.bucket_count(small, n, bucket_ids)
    receiver, sender = sorted((small, n))
    per_bucket = [buckets.padded_size(size, count) for size in (receiver, sender)]
    print(
        f"\n{count} bucket(s) of up to {bucket_ids:,} ids. KKRT16 by construction here: "
        f"{kkrt_formula_bytes(*per_bucket) * count / n:.1f} bytes per id "
        f"of the larger set (1.27 bins x 64 B per receiver id + 3 x "
        f"{kkrt_psi.output_bytes(cuckoo.table_size(per_bucket[0]), per_bucket[1])} B per sender "
        f"id). Reported for KKRT16's own implementation at 2^20 x 2^20 (Raghuraman and Rindal, "
        f"CCS 2022, Table 2): {KKRT16_REPORTED_BITS} bits = {KKRT16_REPORTED_BITS / 8:.0f} bytes "
        f"per id, {KKRT16_REPORTED_MS:,} ms on one thread; RR22: {RR22_REPORTED_BITS} bits "
        f"(log2 n here: {math.log2(n):.1f})"
    )


if __name__ == "__main__":
    main()
