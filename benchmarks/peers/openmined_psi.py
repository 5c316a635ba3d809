"""OpenMined's PSI (``openmined-psi`` 2.0.6, ECDH over P-256) timed on this machine, for
bench_psi.

Run it with the python of the virtualenv that ``make peer-openmined`` makes, never privreg's
own: openmined-psi is a peer measured beside privreg, not one of its dependencies.

Usage: python benchmarks/peers/openmined_psi.py --size N [--small M] [--repeats R]

The client holds M ids (default N), the server N; they share M / 2, the ids of
``id_sets.make_sets``. Client and server run in this one process, 1e-9 false-positive rate,
raw data structure (exact), the client learns only. Prints one JSON document on stdout: the
median seconds, each run's seconds, the median CPU seconds, the peak resident memory, the
bytes of the three messages and the intersection's size.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import resource
import statistics
import sys
import time

from id_sets import make_sets  # this folder: the driver runs as a script from it


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def run_once(client_ids: list[str], server_ids: list[str]) -> dict[str, float]:
    import private_set_intersection.python as om

    started, cpu = time.perf_counter(), _cpu()
    client = om.client.CreateWithNewKey(True)
    server = om.server.CreateWithNewKey(True)
    setup = server.CreateSetupMessage(1e-9, len(client_ids), server_ids, om.DataStructure.RAW)
    request = client.CreateRequest(client_ids)
    response = server.ProcessRequest(request)
    found = len(client.GetIntersection(setup, response))
    wire = sum(len(m.SerializeToString()) for m in (setup, request, response))
    return {
        "seconds": time.perf_counter() - started,
        "cpu": _cpu() - cpu,
        "wire_bytes": wire,
        "found": found,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000, help="ids of the server")
    parser.add_argument("--small", type=int, help="ids of the client (default: --size)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    small = args.small or args.size
    client_ids, server_ids = make_sets(small, args.size)
    runs = [run_once(client_ids, server_ids) for _ in range(args.repeats)]
    if any(r["found"] != small // 2 for r in runs):
        raise SystemExit(f"openmined-psi found {runs[0]['found']}, expected {small // 2}")
    result = {
        "openmined_psi": importlib.metadata.version("openmined-psi"),
        "seconds": statistics.median(r["seconds"] for r in runs),
        "runs": [r["seconds"] for r in runs],
        "cpu": statistics.median(r["cpu"] for r in runs),
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "wire_bytes": runs[0]["wire_bytes"],
        "found": small // 2,
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
