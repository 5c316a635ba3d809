"""privreg's exact discrete Laplace and Gaussian samplers beside OpenDP 0.16's, same run.

Usage: python benchmarks/bench_samplers.py [--repeats R] [--quick]

Issue 40 asks whether ``core/dp/samplers.py`` should give way to a maintained library. This
prints, per distribution and scale (discrete Laplace at 1, 10, 1000; discrete Gaussian at sigma
1, 10, 1000, 10^6) and batch size (1, 1,000, 100,000 draws: privreg draws whole vectors, one
per secure sum or label release), the median wall seconds per batch and microseconds per draw
of

* privreg: ``sample_discrete_laplace(scale, n)`` / ``sample_discrete_gaussian(sigma, n)``,
  an int64 array;
* OpenDP 0.16.0: ``make_laplace`` / ``make_gaussian`` on ``vector_domain(atom_domain(T="i64"))``
  with ``l1_distance`` / ``l2_distance`` over i64 (the integer, i.e. discrete, mechanisms),
  applied to a vector of n zeros; the measurement is built once per scale, outside the timing,
  and the list it returns is turned into an int64 array inside it. Only the ``contrib`` feature
  is enabled: these mechanisms need neither ``honest-but-curious`` nor ``floating-point``.

OpenDP runs in its own virtualenv (``make peer-opendp`` installs it under var/peers/opendp; it
is not one of privreg's dependencies): this script calls itself there with ``--peer`` after
privreg's runs, so the two never compete for the cores. Without that virtualenv OpenDP's
columns say "not measured".

Then 100,000 draws of each at each scale: sample mean and variance against the exact ones
(from the pmf), as z-scores of the sampling error, so the timings compare equal outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OPENDP_PYTHON = ROOT / "var" / "peers" / "opendp" / "bin" / "python"

#: (distribution, scale or sigma)
CASES = [
    ("laplace", 1.0),
    ("laplace", 10.0),
    ("laplace", 1000.0),
    ("gaussian", 1.0),
    ("gaussian", 10.0),
    ("gaussian", 1000.0),
    ("gaussian", 1e6),
]
BATCHES = [1, 1_000, 100_000]
CHECK_SIZE = 100_000


def repeats_for(batch: int, repeats: int) -> int:
    """More repeats for the cheap batches, so their medians are steady."""
    return {1: 50 * repeats, 1_000: 4 * repeats}.get(batch, repeats)


def median_seconds(
    draw: Callable[[int], np.ndarray], batch: int, repeats: int
) -> tuple[float, float]:
    """Median wall and median CPU seconds of this process per ``draw(batch)``."""
    draw(batch)  # warm-up: imports, first allocation
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = draw(batch)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        assert out.shape == (batch,) and out.dtype == np.int64
    return statistics.median(wall), statistics.median(cpu)


# ---------------------------------------------------------------------------- the two sides


def privreg_draws(kind: str, scale: float) -> Callable[[int], np.ndarray]:
    sys.path.insert(0, str(ROOT))
    from core.dp.samplers import sample_discrete_gaussian, sample_discrete_laplace

    sampler = sample_discrete_laplace if kind == "laplace" else sample_discrete_gaussian
    return lambda n: sampler(scale, n)


def opendp_draws(kind: str, scale: float) -> Callable[[int], np.ndarray]:
    import opendp.prelude as dp

    dp.enable_features("contrib")
    domain = dp.vector_domain(dp.atom_domain(T="i64"))
    if kind == "laplace":
        measurement = dp.m.make_laplace(domain, dp.l1_distance(T="i64"), scale=scale)
    else:
        measurement = dp.m.make_gaussian(domain, dp.l2_distance(T="i64"), scale=scale)
    zeros = {n: [0] * n for n in [*BATCHES, CHECK_SIZE]}
    return lambda n: np.asarray(measurement(zeros[n]), dtype=np.int64)


def measure(make: Callable[[str, float], Callable[[int], np.ndarray]], repeats: int) -> dict:
    """Median seconds per batch for every case, and the check's 100k draws of each."""
    timings, samples = {}, {}
    for kind, scale in CASES:
        draw = make(kind, scale)
        for batch in BATCHES:
            key = f"{kind} {scale:g} {batch}"
            timings[key] = median_seconds(draw, batch, repeats_for(batch, repeats))
        samples[f"{kind} {scale:g}"] = draw(CHECK_SIZE).tolist()
    return {"timings": timings, "samples": samples}


def run_opendp(repeats: int) -> tuple[dict | None, str]:
    if not OPENDP_PYTHON.exists():
        return None, "not measured: run `make bench-samplers` (it installs OpenDP 0.16.0 first)"
    command = [str(OPENDP_PYTHON), str(Path(__file__).resolve()), "--peer"]
    command += ["--repeats", str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return None, f"not measured: the OpenDP run failed (exit {done.returncode})"
    return json.loads(done.stdout.strip().splitlines()[-1]), ""


# ---------------------------------------------------------------------------- exact moments


def exact_variance(kind: str, scale: float) -> float:
    """Variance of the distribution (its mean is 0 by symmetry)."""
    if kind == "laplace":
        ratio = math.exp(-1.0 / scale)
        return 2.0 * ratio / (1.0 - ratio) ** 2
    if scale > 1e4:
        # the discrete Gaussian's variance differs from sigma^2 by a relative
        # 4 pi^2 sigma^2 exp(-2 pi^2 sigma^2) at most (CKS 2020), far below float precision here
        return scale * scale
    reach = int(40 * scale) + 40
    support = np.arange(-reach, reach + 1, dtype=np.float64)
    weights = np.exp(-(support**2) / (2.0 * scale * scale))
    return float((support**2 * weights).sum() / weights.sum())


def check_row(name: str, kind: str, scale: float, values: list[int]) -> list[str]:
    x = np.asarray(values, dtype=np.float64)
    n, variance = x.size, exact_variance(kind, scale)
    mean, sample_var = float(x.mean()), float(x.var())
    fourth = float(((x - mean) ** 4).mean())
    z_mean = mean / math.sqrt(variance / n)
    z_var = (sample_var - variance) / math.sqrt(max(fourth - sample_var**2, 1e-300) / n)
    return [
        name,
        f"{kind} {scale:g}",
        f"{mean:.4g}",
        f"{z_mean:+.2f}",
        f"{sample_var:.6g}",
        f"{variance:.6g}",
        f"{sample_var / variance - 1:+.2%}",
        f"{z_var:+.2f}",
    ]


# ---------------------------------------------------------------------------- report


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def report(privreg: dict, opendp: dict | None, note: str, repeats: int) -> str:
    rows = []
    for kind, scale in CASES:
        for batch in BATCHES:
            key = f"{kind} {scale:g} {batch}"
            ours, ours_cpu = privreg["timings"][key]
            row = [
                f"discrete {kind}",
                f"{scale:g}",
                f"{batch:,}",
                f"{ours:.3g}",
                f"{ours / batch * 1e6:.3g}",
            ]
            if opendp is None:
                row += [note, "", "", ""]
            else:
                theirs, theirs_cpu = opendp["timings"][key]
                row += [
                    f"{theirs:.3g}",
                    f"{theirs / batch * 1e6:.3g}",
                    f"{theirs / ours:.2f}",
                    f"{theirs_cpu / ours_cpu:.2f}" if ours_cpu > 0 else "",
                ]
            rows.append(row)
    headers = [
        "sampler",
        "scale / sigma",
        "batch",
        "privreg s/batch",
        "privreg µs/draw",
        "OpenDP s/batch",
        "OpenDP µs/draw",
        "OpenDP / privreg, wall",
        "OpenDP / privreg, CPU",
    ]
    text = (
        f"## Exact samplers: privreg vs OpenDP 0.16.0, median wall seconds (batch 1: median of "
        f"{repeats_for(1, repeats)}, 1,000: of {repeats_for(1_000, repeats)}, 100,000: of "
        f"{repeats}; load average {os.getloadavg()[0]:.1f} at the end)\n\n"
        f"{table(headers, rows)}\n\n"
        "A ratio above 1: OpenDP takes longer. CPU: the ratio of the median CPU seconds of each "
        "side's process, steadier than wall time on a busy machine (at batch 1 the CPU clock's "
        "resolution blurs it). privreg returns an int64 array; OpenDP's list is converted to "
        "one inside its timing (a few ms at 100,000).\n"
    )
    checks = []
    for kind, scale in CASES:
        name = f"{kind} {scale:g}"
        checks.append(check_row("privreg", kind, scale, privreg["samples"][name]))
        if opendp is not None:
            checks.append(check_row("OpenDP", kind, scale, opendp["samples"][name]))
    headers = [
        "sampler",
        "distribution",
        "mean",
        "z (mean)",
        "variance",
        "exact variance",
        "rel. diff",
        "z (variance)",
    ]
    text += (
        f"\n## Distributional check: {CHECK_SIZE:,} draws of each (mean 0 exactly)\n\n"
        f"{table(headers, checks)}\n\n"
        "z: the difference over its standard error (from the sample's fourth moment); |z| "
        "above 4 would mean the two samplers do not draw the same distribution.\n"
    )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats at batch 100,000")
    parser.add_argument("--quick", action="store_true", help="one repeat (a smoke run)")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    if args.peer:  # inside OpenDP's virtualenv: print one JSON document
        print(json.dumps(measure(opendp_draws, repeats)))
        return
    privreg = measure(privreg_draws, repeats)
    opendp, note = run_opendp(repeats)
    print(report(privreg, opendp, note, repeats))


if __name__ == "__main__":
    main()
