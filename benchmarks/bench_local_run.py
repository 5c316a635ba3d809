"""The demo's job files run locally (every side a thread of one process, ``make demo``) and
with every organisation its own process (``make demo-parties``): wall and CPU side by side.

Why: a local run's sides are threads, not processes, by measurement (docs/federation.md);
this prints the measurement instead of a figure typed into the docs. Each run starts fresh: a
temporary folder holds the job files, the demo data and every database, and Prefect's home,
so nothing is reused from an earlier run. CPU is the process tree's, sampled from ``/proc``
(benchmarks/process_cpu.py), so the Paillier pools' workers and the temporary Prefect servers
count too.

    python benchmarks/bench_local_run.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.process_cpu import ProcessCpu  # noqa: E402
from demo.parties import ORGS_VARIABLE  # noqa: E402

RUNS = {
    "make demo (every side a thread)": ["-m", "flows.pipeline"],
    "make demo-parties (every side its own process)": ["demo/parties.py"],
}


def _folder(base: Path) -> Path:
    """A fresh copy of what the demo reads: job files and data, no var/."""
    for name in ("jobs", "demo"):
        shutil.copytree(ROOT / name, base / name)
    return base


def run_once(args: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run in a fresh folder with a fresh Prefect home."""
    with tempfile.TemporaryDirectory(prefix="privreg-bench-local-") as tmp:
        folder = _folder(Path(tmp))
        env = {
            **os.environ,
            "PREFECT_HOME": str(folder / "prefect"),
            "PYTHONPATH": str(ROOT),
            "PRIVREG_HOME": str(folder / "var"),
            ORGS_VARIABLE: str(folder / "orgs"),
        }
        env.pop("PREFECT_API_URL", None)
        script = args if args[0] == "-m" else [str(ROOT / args[0])]
        with ProcessCpu() as cpu:
            begun, started = time.time(), time.perf_counter()
            process = subprocess.Popen(
                [sys.executable, *script], cwd=folder, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            cpu.watch(process.pid, "run")
            code = process.wait()
            wall = time.perf_counter() - started
            cpu.sample()
            used = sum(cpu.between(begun, time.time()).values())
        if code != 0:
            raise SystemExit(f"{' '.join(args)} failed with status {code}")
        return wall, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    repeats = parser.parse_args().repeats
    print(f"# the demo's job files, fresh folders, medians of {repeats}; {os.cpu_count()} cores")
    print("| run | wall (s) | CPU (s, the process tree) |")
    print("|---|---|---|")
    for label, args in RUNS.items():
        results = [run_once(args) for _ in range(repeats)]
        wall = statistics.median(r[0] for r in results)
        used = statistics.median(r[1] for r in results)
        print(f"| {label} | {wall:.1f} | {used:.1f} |", flush=True)


if __name__ == "__main__":
    main()
