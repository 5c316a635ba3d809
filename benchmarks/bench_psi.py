"""PSI throughput: privreg's KKRT16 OT-extension protocol and its X25519 ECDH protocol beside
openmined-psi, in the same run.

Usage: python benchmarks/bench_psi.py [--size N] [--repeats R] [--no-baseline] [--no-ecdh]

Both sets have N ids with 50% overlap. "ids/s" counts both sets (2N ids) per second of the
whole protocol, as openmined-psi's published figure does; times are wall-clock seconds from
the ids in memory to both parties' ordered rows of the intersection.

* privreg KKRT16: the two parties are two OS processes that exchange their five messages over
  privreg's channel (``PartyEndpoint.send/receive``, the file transport in a temporary folder:
  the same code path as one process or mTLS, without the network). Each process hashes its
  ids, runs its role, and both prove they hold the same ordered ids (an order digest).
  Bytes on the wire are the encoded messages as the channel stored them.
* privreg X25519 ECDH: both parties' steps in this process (each step uses a process pool).
* openmined-psi: client and server in this process, 1e-9 false-positive rate, raw data
  structure (exact), the client learns only.

Peak memory is the largest resident set of one party process (KKRT) or of this process and
its children (ECDH, openmined-psi). "cpu s" is user + system time of all processes.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass

from core import psi
from core.ids import id_order_digest
from core.psi_ot import cuckoo, kkrt
from core.psi_ot import protocol as kkrt_psi
from storage.channel import Channel


def make_sets(size: int) -> tuple[list[str], list[str]]:
    shared = [f"user-{i:09d}" for i in range(size // 2)]
    a = shared + [f"a-only-{i:09d}" for i in range(size - len(shared))]
    b = shared + [f"b-only-{i:09d}" for i in range(size - len(shared))]
    return a, b


@dataclass
class Run:
    seconds: float
    found: int
    cpu: float
    peak_mib: float
    wire_bytes: int = 0


def _cpu() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _peak_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def _kkrt_party(party: str, peer: str, ids: list[str], root: str, out: multiprocessing.Queue):
    """One party's whole side over the channel, as the party flow runs it."""
    endpoint = Channel(root, "bench", timeout=600).endpoint(party)
    key = kkrt_psi.new_party_key()
    digests = kkrt_psi.item_digests(ids, party)
    if kkrt_psi.is_receiver(party, peer):
        endpoint.send(peer, kkrt_psi.KIND_HELLO, kkrt_psi.hello(key, len(ids)))
        reply = endpoint.receive(peer, kkrt_psi.KIND_REPLY)
        message, state = kkrt_psi.matrix(key, digests, reply, peer)
        endpoint.send(peer, kkrt_psi.KIND_MATRIX, message)
        found = kkrt_psi.match(state, endpoint.receive(peer, kkrt_psi.KIND_VALUES), peer)
        endpoint.send(peer, kkrt_psi.KIND_RESULT, kkrt_psi.result_message(found, 1))
        result = found.result
    else:
        hello = endpoint.receive(peer, kkrt_psi.KIND_HELLO)
        endpoint.send(peer, kkrt_psi.KIND_REPLY, kkrt_psi.reply(key, len(ids), hello, peer))
        matrix = endpoint.receive(peer, kkrt_psi.KIND_MATRIX)
        values = kkrt_psi.values(key, digests, hello, matrix, peer)
        endpoint.send(peer, kkrt_psi.KIND_VALUES, values)
        answer = endpoint.receive(peer, kkrt_psi.KIND_RESULT)
        result = kkrt_psi.sender_result(key, len(ids), int(hello["size"]), answer, peer)
    order = id_order_digest("bench", (ids[i] for i in result.rows))
    out.put((party, result.size, order, _cpu(), _peak_mib()))


def run_kkrt(a: list[str], b: list[str]) -> Run:
    context = multiprocessing.get_context("fork")  # the id lists are inherited, not pickled
    with tempfile.TemporaryDirectory() as root:
        out = context.Queue()
        started = time.perf_counter()
        parties = [
            context.Process(target=_kkrt_party, args=("a", "b", a, root, out)),
            context.Process(target=_kkrt_party, args=("b", "a", b, root, out)),
        ]
        for process in parties:
            process.start()
        reports = [out.get() for _ in parties]
        seconds = time.perf_counter() - started
        for process in parties:
            process.join()
            assert process.exitcode == 0
        wire = sum(record.size for record in Channel(root, "bench").log())
    (_, size_a, order_a, cpu_a, peak_a), (_, size_b, order_b, cpu_b, peak_b) = reports
    assert size_a == size_b and order_a == order_b, "the two sides' rows differ"
    return Run(seconds, size_a, cpu_a + cpu_b, max(peak_a, peak_b), wire)


def run_ecdh(a: list[str], b: list[str]) -> Run:
    started, cpu = time.perf_counter(), _cpu()
    key_a, key_b = psi.new_key(), psi.new_key()
    sent_a, sent_b = psi.prepare(a, key_a), psi.prepare(b, key_b)
    a_double = psi.reblind(sent_a.blinded, key_b)
    b_double = psi.reblind(sent_b.blinded, key_a)
    result_a = psi.intersect(a_double, sent_a.rows, b_double)
    result_b = psi.intersect(b_double, sent_b.rows, a_double)
    assert result_a.size == result_b.size
    wire = 2 * 2 * len(a) * psi.POINT_BYTES
    return Run(time.perf_counter() - started, result_a.size, _cpu() - cpu, _peak_mib(), wire)


def run_openmined(a: list[str], b: list[str]) -> Run:
    import private_set_intersection.python as om

    started, cpu = time.perf_counter(), _cpu()
    client = om.client.CreateWithNewKey(True)
    server = om.server.CreateWithNewKey(True)
    setup = server.CreateSetupMessage(1e-9, len(a), b, om.DataStructure.RAW)
    request = client.CreateRequest(a)
    response = server.ProcessRequest(request)
    found = len(client.GetIntersection(setup, response))
    wire = sum(len(m.SerializeToString()) for m in (setup, request, response))
    return Run(time.perf_counter() - started, found, _cpu() - cpu, _peak_mib(), wire)


def kkrt_formula_bytes(size: int) -> float:
    """KKRT16's communication by construction, per id: the OT-extension matrix (``k`` bits per
    cuckoo bin, ``k`` = 512 here) and three truncated OPRF values per sender id."""
    bins = cuckoo.table_size(size)
    values = 3 * size * kkrt_psi.output_bytes(bins, size)
    return (bins * kkrt.WIDTH / 8 + values) / size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip openmined-psi")
    parser.add_argument("--no-ecdh", action="store_true", help="skip privreg's ECDH")
    args = parser.parse_args()
    a, b = make_sets(args.size)
    runners = {"privreg KKRT16, 2 processes over the channel (both learn)": run_kkrt}
    if not args.no_ecdh:
        runners["privreg X25519 ECDH, one process (both learn)"] = run_ecdh
    if not args.no_baseline:
        runners["openmined-psi 2.x P-256 (client learns)"] = run_openmined
    runs: dict[str, list[Run]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            outcome = run(a, b)
            assert outcome.found == args.size // 2, (name, outcome.found)
            runs[name].append(outcome)
    n = args.size
    print(f"\n### PSI, {n:,} x {n:,} ids, 50% overlap, median of {args.repeats}\n")
    print("| implementation | median s | ids/s | cpu s | peak MiB | wire bytes/id |")
    print("|---|---|---|---|---|---|")
    for name, samples in runs.items():
        median = statistics.median(r.seconds for r in samples)
        cpu = statistics.median(r.cpu for r in samples)
        peak = max(r.peak_mib for r in samples)
        wire = samples[0].wire_bytes / n
        print(
            f"| {name} | {median:.2f} | {2 * n / median:,.0f} | {cpu:.1f} | {peak:,.0f} "
            f"| {wire:.1f} |"
        )
    log_n = math.log2(n)
    print(
        f"\nKKRT16 by construction at this size: {kkrt_formula_bytes(n):.1f} bytes/id "
        f"(1.27 bins x 64 B + 3 x {kkrt_psi.output_bytes(cuckoo.table_size(n), n)} B); "
        f"RR22 publishes 187 bits/id = 23.4 bytes at 2^20 (log2 n here: {log_n:.1f})"
    )


if __name__ == "__main__":
    main()
