"""PSI throughput and memory: privreg's KKRT16 OT-extension protocol (the default), its RR22
VOLE/OKVS protocol and its X25519 ECDH protocol beside openmined-psi, in the same run.

Usage: python benchmarks/bench_psi.py [--size N] [--small M] [--repeats R] [--no-baseline]
                                      [--no-ecdh] [--no-rr22] [--bucket-ids B]

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
* privreg RR22 (``protocol: "rr22"``): the same two processes, running ``tasks.psi_rr22``.
  "bits/id" is 8 x the bytes both parties sent (as the channel stored them, framing included)
  per id of the larger set: the issue's target is at most 300.
* privreg X25519 ECDH: both parties' steps in this process, from the ids in memory.
* SecretFlow's RR22 and KKRT16 (``spu`` 0.9.5, libpsi) at 100k and 1M, balanced sets only: two
  processes over loopback, both learn, run from spu's own virtualenv (``make bench-psi`` makes
  it; without it the rows say "not measured") by ``benchmarks/peers/spu_psi.py``.
* openmined-psi 2.0.6: client and server in one process, 1e-9 false-positive rate, raw data
  structure (exact), the client learns only; run from its own virtualenv (``make bench-psi``
  makes it; without it the row says "not measured") by ``benchmarks/peers/openmined_psi.py``.

"cpu s" is user + system time of all processes; peak MiB is the largest resident set of one
party process (KKRT), of this process and its children (ECDH) or of the peer's processes.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers.id_sets import make_sets
from core import psi
from core.psi_ot import buckets, cuckoo, kkrt
from core.psi_ot import protocol as kkrt_psi

#: KKRT16 at n = 2^20 as reported in Raghuraman and Rindal, "Blazing Fast PSI from Improved
#: OKVS and Subfield VOLE" (CCS 2022), Table 2, for the authors' implementation on one
#: thread: 1008 bits per id and 2,073 ms; RR22 itself: 251 bits (fast) or 180 (low comm.).
KKRT16_REPORTED_BITS, KKRT16_REPORTED_MS, RR22_REPORTED_BITS = 1008, 2073, 180
#: balanced sizes at which SecretFlow's RR22 and KKRT (spu 0.9.5, installed by ``make bench-psi``
#: into its own virtualenv) run beside privreg in the same run (benchmarks/peers/spu_psi.py)
SPU_SIZES = (100_000, 1_000_000)


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
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase -> [wall, cpu, calls]


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


class Phases:
    """Wall and CPU seconds per phase of one party process, each phase exclusive of the phases
    it calls (a phase is a function of privreg's code, wrapped by :meth:`watch`). "cpu" counts
    the process and its reaped children (the hashing pool)."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}  # phase -> [wall, cpu, calls]
        self._stack: list[list[float]] = []  # per open phase: [wall, cpu] spent in callees

    def watch(self, owner: object, attribute: str, phase: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), _cpu()
            self._stack.append([0.0, 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                nested = self._stack.pop()
                spent = [time.perf_counter() - wall, _cpu() - cpu]
                total = self.totals.setdefault(phase, [0.0, 0.0, 0])
                total[0] += spent[0] - nested[0]
                total[1] += spent[1] - nested[1]
                total[2] += 1
                if self._stack:
                    self._stack[-1][0] += spent[0]
                    self._stack[-1][1] += spent[1]

        setattr(owner, attribute, timed)


#: (module, attribute, phase): what the phase table times in a party process.
PHASES = (
    ("tasks.psi_kkrt", "_digest_rows", "load ids from DuckDB, store digests"),
    ("core.psi_ot.protocol", "item_digests", "hash ids (canonical form, SHA-256)"),
    ("tasks.psi_kkrt", "_bucket", "read a bucket's digests"),
    ("core.psi_ot.base_ot", "receiver_choose", "base OTs (P-256)"),
    ("core.psi_ot.base_ot", "sender_keys", "base OTs (P-256)"),
    ("core.psi_ot.buckets", "pad", "pad bucket, cuckoo, permutation"),
    ("core.psi_ot.protocol", "_placement", "pad bucket, cuckoo, permutation"),
    ("core.psi_ot.protocol", "random_permutation", "pad bucket, cuckoo, permutation"),
    ("core.psi_ot.cuckoo", "candidate_bins", "pad bucket, cuckoo, permutation"),
    ("core.psi_ot.kkrt", "pseudorandom_code", "pseudorandom code C (AES)"),
    ("core.psi_ot.kkrt", "receiver_matrices", "OT extension (PRG, transpose)"),
    ("core.psi_ot.kkrt", "sender_rows", "OT extension (PRG, transpose)"),
    ("core.psi_ot.kkrt", "row_hash", "OPRF outputs H (BLAKE2b)"),
    ("core.psi_ot.protocol", "sender_bucket", "OPRF evaluation, other"),
    ("core.psi_ot.protocol", "evaluate", "OPRF evaluation, other"),
    ("core.psi_ot.protocol", "extend", "OT extension, other"),
    ("core.psi_ot.protocol", "match", "matching"),
    ("core.psi_ot.protocol", "sender_rows", "matching"),
    ("storage.secrets.SealedArtifacts", "put", "seal and store state"),
    ("storage.secrets.SealedArtifacts", "get", "seal and store state"),
    ("storage.codec", "dumps", "encode messages"),
    ("storage.codec", "loads", "decode messages"),
    ("federation.channel.MessageFolder", "put", "write messages (file, fsync)"),
    ("federation.channel.FileTransport", "get", "wait for and read peer's messages"),
    ("federation.channel.Channel", "_write", "message digest (SHA-256), other"),
    ("tasks.psi_kkrt", "_insert", "insert rows (DuckDB)"),
    ("storage.party_store.PartyStore", "fingerprint", "fingerprint source table"),
    ("tasks.psi_kkrt", "_write", "write aligned table (DuckDB)"),
)


def _watch_phases() -> Phases:
    import importlib

    phases = Phases()
    for path, attribute, phase in PHASES:
        try:
            target = importlib.import_module(path)
        except ModuleNotFoundError:  # "package.module.Class"
            module, _, owner = path.rpartition(".")
            target = getattr(importlib.import_module(module), owner)
        phases.watch(target, attribute, phase)
    return phases


def _kkrt_party(
    party: str,
    peer: str,
    database: str,
    root: str,
    out,
    go,
    with_phases: bool = False,
    protocol: str = "kkrt",
) -> None:
    """One party's whole side, as ``psi_align_party`` runs it (steps called directly; KKRT16
    or RR22 by ``protocol``); its clock and CPU count start once its modules are imported
    and both parties are ready."""
    from prefect.logging import disable_run_logger

    from federation.channel import Channel
    from federation.workspace import channel_for
    from storage.descriptor import TableRef
    from storage.party_store import PartyStore
    from tasks import psi_kkrt, psi_rr22
    from tasks.psi import PsiSide

    ref = TableRef(database, "ids", party=party)
    phases = _watch_phases() if with_phases else Phases()
    out.put(("ready", _peak_mib()))
    go.wait()
    start, started = _cpu(), time.perf_counter()
    with disable_run_logger():
        side = PsiSide(ref, peer, Channel(root, "bench").endpoint(party))
        steps = psi_rr22 if protocol == "rr22" else psi_kkrt
        summary = steps.party_side(side, 1, call=lambda step, *args: step.fn(*args))
    cpu, peak = _cpu() - start, _peak_mib()
    timed = [sum(t[i] for t in phases.totals.values()) for i in (0, 1)]
    phases.totals["other (task code, transactions, Python)"] = [
        time.perf_counter() - started - timed[0],
        cpu - timed[1],
        0,
    ]
    with PartyStore(database).connect() as con:
        order = con.execute(
            f"SELECT count(*), sum(hash(rowid::VARCHAR || ':' || id) % 1000000007) FROM \"{summary['table']}\""  # noqa: E501
        ).fetchone()
    totals = channel_for("bench", root).bytes_by_party().get(party, {"sent": 0, "received": 0})
    receiver = summary["own_size"] < summary["peer_size"] or (
        summary["own_size"] == summary["peer_size"] and party < peer
    )
    out.put((party, receiver, summary["own_size"], order, cpu, peak, totals, phases.totals))


def run_kkrt(small: int, size: int, with_phases: bool = False, protocol: str = "kkrt") -> Run:
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
            context.Process(
                target=_kkrt_party,
                args=(p, q, databases[p], root, out, go, with_phases, protocol),
            )
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
        Party(name, receiver, ids, cpu, peak, totals["sent"], totals["received"], phases)
        for name, receiver, ids, _, cpu, peak, totals, phases in sorted(reports)
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


def kkrt_formula_bytes(plan: buckets.Plan) -> tuple[int, int]:
    """KKRT16's communication by construction, from the receiver's plan: the OT-extension
    matrix (``k`` = 512 bits per cuckoo bin of the receiver, per bucket or once with one
    table) and three truncated OPRF values per sender id; and the values' width in bytes."""
    bins = cuckoo.table_size(plan.own_padded)
    width = kkrt_psi.output_bytes(bins, plan.peer_padded * plan.compared_buckets)
    matrices = 1 if plan.one_table else plan.buckets
    return matrices * bins * kkrt.WIDTH // 8 + 3 * plan.buckets * plan.peer_padded * width, width


def print_phases(run: Run) -> None:
    """Each party's phases side by side: wall (waits included) and CPU seconds."""
    names = list(dict.fromkeys(name for party in run.parties for name in party.phases))
    names.sort(key=lambda name: name.startswith("other"))
    header = " | ".join(
        f"{p.name} ({'R' if p.receiver else 'S'}) wall s | cpu s | calls" for p in run.parties
    )
    print(
        f"\nPhases per party, last run ({run.seconds:.1f} s wall; each phase exclusive of the "
        "phases it calls; a wait shows as wall without CPU):\n"
    )
    print(f"| phase | {header} |")
    print("|---|" + "---|---|---|" * len(run.parties))
    for name in names:
        cells = []
        for party in run.parties:
            wall, cpu, calls = party.phases.get(name, [0.0, 0.0, 0])
            cells.append(f"{wall:.2f} | {cpu:.2f} | {calls or ''}")
        print(f"| {name} | {' | '.join(cells)} |")


def peer_rows_for(small: int, size: int, repeats: int, openmined: bool) -> list[list[str]]:
    """The peers' rows, rerun now (after privreg's runs, so they never share the cores), each
    from its own virtualenv: openmined-psi, then SecretFlow's (balanced sizes it runs at)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.peers.beside import openmined_rows, spu_rows

    rows = openmined_rows(small, size, repeats) if openmined else []
    return rows + (spu_rows(size, repeats) if small == size and size in SPU_SIZES else [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=100_000, help="ids of the larger party")
    parser.add_argument("--small", type=int, help="ids of the other party (default: --size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip openmined-psi")
    parser.add_argument("--no-ecdh", action="store_true", help="skip privreg's ECDH")
    parser.add_argument("--no-rr22", action="store_true", help="skip privreg's RR22")
    parser.add_argument("--bucket-ids", type=int, help="KKRT ids per bucket (default: privreg's)")
    parser.add_argument(
        "--phases", action="store_true", help="time each KKRT party's phases (last run)"
    )
    args = parser.parse_args()
    n, small = args.size, args.small or args.size
    os.environ.setdefault("PRIVREG_RECEIVE_TIMEOUT", "7200")  # the party processes wait this long
    if args.bucket_ids:
        os.environ["PRIVREG_PSI_BUCKET_IDS"] = str(args.bucket_ids)
    runners = {
        "privreg KKRT16, 2 party processes over the channel (both learn)": (
            lambda small, n: run_kkrt(small, n, args.phases)
        )
    }
    if not args.no_rr22:
        name = "privreg RR22, 2 party processes over the channel (both learn)"
        runners[name] = lambda small, n: run_kkrt(small, n, protocol="rr22")
    if not args.no_ecdh:
        runners["privreg X25519 ECDH, one process (both learn)"] = run_ecdh
    runs: dict[str, list[Run]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            outcome = run(small, n)
            assert outcome.found == small // 2, (name, outcome.found)
            runs[name].append(outcome)
    peer_rows = peer_rows_for(small, n, args.repeats, not args.no_baseline)
    print(f"\n### PSI, {small:,} x {n:,} ids, {small // 2:,} shared, median of {args.repeats}\n")
    print("| implementation | median s | ids/s | cpu s | peak MiB | wire bytes/id | bits/id |")
    print("|---|---|---|---|---|---|---|")
    for name, samples in runs.items():
        median = statistics.median(r.seconds for r in samples)
        cpu = statistics.median(r.cpu for r in samples)
        peak = max(r.peak_mib for r in samples)
        wire = samples[0].wire_bytes / n
        print(
            f"| {name} | {median:.2f} | {(small + n) / median:,.0f} | {cpu:.1f} | {peak:,.0f} "
            f"| {wire:.1f} | {8 * wire:.0f} |"
        )
    for row in peer_rows:  # the peers' rows have no bits/id (their wire is not counted here)
        print("| " + " | ".join(row + [""] * (7 - len(row))) + " |")
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
    if args.phases:
        print_phases(kkrt_runs[-1])
    bucket_ids = args.bucket_ids or buckets.BUCKET_IDS
    receiver, sender = sorted((small, n))
    plan = kkrt_psi.plan("a", "b", receiver, bucket_ids, kkrt_psi.size_message(sender, bucket_ids))
    total, width = kkrt_formula_bytes(plan)
    tables = "one receiver table" if plan.one_table else "a receiver table per bucket"
    print(
        f"\n{plan.buckets} bucket(s) of up to {bucket_ids:,} ids, {tables}. KKRT16 by "
        f"construction here: {total / n:.1f} bytes per id of the larger set (1.27 bins x 64 B "
        f"per receiver id + 3 x {width} B per sender id, padding included). "
        "Reported for KKRT16's own implementation at 2^20 x 2^20 (Raghuraman and Rindal, "
        f"CCS 2022, Table 2): {KKRT16_REPORTED_BITS} bits = {KKRT16_REPORTED_BITS / 8:.0f} bytes "
        f"per id, {KKRT16_REPORTED_MS:,} ms on one thread; RR22: {RR22_REPORTED_BITS} bits "
        f"(log2 n here: {math.log2(n):.1f})"
    )


if __name__ == "__main__":
    main()
