"""How fast ``privreg`` answers (part of ``make bench-federation``).

Each command that only looks (``--help``, ``job status``, ``budget show``, ``models list``,
``job check``) runs ``--repeats`` times as a fresh process; the table gives the median wall
time and the median CPU time (user + system of the process, from ``wait4``), and whether the
command loaded Prefect (from one more run under ``-X importtime``). Targets: ``--help`` under
0.3 s of wall time, the others under 1 s of CPU, and none loading Prefect (only commands that
run a flow need it).

The files looked at are made in a temporary folder: a party database with a budget and two
jobs' releases charged to it (as the demo's WALR and a label release would), a party
configuration with a job's status record, and the repository's ``jobs/demo.json``.
``--database`` points ``budget show`` and ``models list`` at a database of your own instead
(a ledger from before figures were stored with each charge composes them on its first show).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def files(folder: Path) -> tuple[Path, Path]:
    """A party database with a budget and two jobs' releases charged to it, and a party.toml
    whose job ``credit`` has a record."""
    import pandas as pd

    from core.dp.accounting import DiscreteGaussian, PureDP
    from federation import certs
    from federation.channel import FileTransport
    from federation.status import PartyStatus
    from storage.descriptor import TableRef
    from storage.ledger import PrivacyLedger
    from storage.party_store import PartyStore

    ref = TableRef(str(folder / "bank.duckdb"), "customers")
    store = PartyStore.of(ref)
    store.import_frame(pd.DataFrame({"id": range(100), "x": [0.5] * 100}), ref)
    ledger = PrivacyLedger(store)
    ledger.set_budget("customers", 6.0, 1e-5)
    walr = DiscreteGaussian(67553, 273261, "vector")  # the demo's WALR release
    ledger.charge_and_store("w", "customers", 1.0, 1e-6, "walr", "demo-walr", [0], event=walr)
    ledger.charge_and_store("l", "customers", 0.5, 0.0, "rr", "labels", [0], event=PureDP(0.5))
    ca = certs.create_ca(folder / "ca")
    issued = certs.issue(ca, "bank", folder / "bank")
    config = folder / "party.toml"
    config.write_text(
        f'party = "bank"\nroot = "home"\n[tls]\nca = "{ca.cert}"\n'
        f'cert = "{issued.cert}"\nkey = "{issued.key}"\n'
    )
    record = PartyStatus("bank", "credit", "done", ("bank",), heartbeat=time.time(), seq=1)
    FileTransport(folder / "home").publish_status("credit", "bank", record.to_bytes())
    return Path(ref.database), config


def measure(argv: list[str], repeats: int) -> tuple[float, float, bool]:
    """(median wall s, median CPU s, Prefect loaded) of ``privreg ARGV`` in fresh processes."""
    command = [sys.executable, "-m", "privreg.cli", *argv]
    walls, cpus = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)  # fmt: skip
        _, status, usage = os.wait4(child.pid, 0)
        walls.append(time.perf_counter() - started)
        cpus.append(usage.ru_utime + usage.ru_stime)
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode not in (0, 1):
            raise RuntimeError(f"privreg {' '.join(argv)} exited with {child.returncode}")
    traced = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "privreg.cli", *argv], cwd=ROOT,
        capture_output=True, text=True,
    )  # fmt: skip
    names = [line.rsplit("|", 1)[-1].strip() for line in traced.stderr.splitlines()]
    return statistics.median(walls), statistics.median(cpus), "prefect" in names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (median)")
    parser.add_argument("--database", help="a party database for budget show and models list")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as folder:
        database, config = files(Path(folder))
        database = Path(args.database).resolve() if args.database else database
        commands = {
            "--help": ["--help"],
            "job status": ["job", "status", "credit", "--config", str(config)],
            "budget show": ["budget", "show", "--database", str(database)],
            "models list": ["models", "list", "--database", str(database)],
            "job check": ["job", "check", "jobs/demo.json"],
        }
        print(f"privreg start-up, median of {args.repeats} fresh processes")
        print(f"{'command':<14} {'wall s':>7} {'CPU s':>7}  prefect loaded")
        for name, argv in commands.items():
            wall, cpu, loaded = measure(argv, args.repeats)
            print(f"{name:<14} {wall:7.2f} {cpu:7.2f}  {'yes' if loaded else 'no'}", flush=True)


if __name__ == "__main__":
    main()
