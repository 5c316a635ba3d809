"""PSI throughput: privreg's X25519 protocol beside openmined-psi, in the same run.

Usage: python benchmarks/bench_psi.py [--size N] [--repeats R] [--no-baseline]

Both sets have N ids with 50% overlap. "ids/s" counts both sets (2N ids) per second of the
whole protocol, as openmined-psi's published figure does. privreg runs both parties' steps
in this process (each step uses a process pool over the machine's cores); openmined-psi runs
its client and server in this process with a 1e-9 false-positive rate and the raw data
structure (exact). Peak memory is the resident set of this process and its children.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from core import psi


def make_sets(size: int) -> tuple[list[str], list[str]]:
    shared = [f"user-{i:09d}" for i in range(size // 2)]
    a = shared + [f"a-only-{i:09d}" for i in range(size - len(shared))]
    b = shared + [f"b-only-{i:09d}" for i in range(size - len(shared))]
    return a, b


def run_privreg(a: list[str], b: list[str]) -> int:
    key_a, key_b = psi.new_key(), psi.new_key()
    sent_a, sent_b = psi.prepare(a, key_a), psi.prepare(b, key_b)
    a_double = psi.reblind(sent_a.blinded, key_b)
    b_double = psi.reblind(sent_b.blinded, key_a)
    result_a = psi.intersect(a_double, sent_a.rows, b_double)
    result_b = psi.intersect(b_double, sent_b.rows, a_double)
    assert result_a.size == result_b.size
    return result_a.size


def run_openmined(a: list[str], b: list[str]) -> int:
    import private_set_intersection.python as om

    client = om.client.CreateWithNewKey(True)
    server = om.server.CreateWithNewKey(True)
    setup = server.CreateSetupMessage(1e-9, len(a), b, om.DataStructure.RAW)
    response = server.ProcessRequest(client.CreateRequest(a))
    return len(client.GetIntersection(setup, response))


def peak_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    a, b = make_sets(args.size)
    runners = {"privreg X25519 (both learn)": run_privreg}
    if not args.no_baseline:
        runners["openmined-psi 2.x P-256 (client learns)"] = run_openmined
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            started = time.perf_counter()
            found = run(a, b)
            times[name].append(time.perf_counter() - started)
            assert found == args.size // 2, (name, found)
    print(f"\n### PSI, {args.size:,} x {args.size:,} ids, 50% overlap, median of {args.repeats}\n")
    print("| implementation | median s | ids/s | vs openmined-psi |")
    print("|---|---|---|---|")
    baseline = statistics.median(times[list(runners)[-1]]) if not args.no_baseline else None
    for name, samples in times.items():
        median = statistics.median(samples)
        ratio = f"{baseline / median:.2f}x" if baseline else "-"
        print(f"| {name} | {median:.2f} | {2 * args.size / median:,.0f} | {ratio} |")
    print(f"\npeak resident memory (this process + children): {peak_mib():,.0f} MiB")


if __name__ == "__main__":
    main()
