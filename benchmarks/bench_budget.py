"""``make bench-budget``: what thirty nightly runs of the demo's jobs cost each protected table,
added up (basic composition) against composed by the accountant (PLD, at the owner's delta).

Runs the demo's job files once in a scratch folder (as ``privreg run`` would, every party in
this machine), reads each party's ledger, and repeats one night's releases 30 times on paper:
the figures are the accountant's own functions over the events the run really charged.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.dp.accounting import Charge, basic_epsilon, composed_epsilon  # noqa: E402
from storage.ledger import PrivacyLedger  # noqa: E402
from storage.party_store import PartyStore  # noqa: E402

JOBS = ("demo.json", "horizontal_demo.json")
"""The main job (PSI, vertical LR, WALR and its label-DP and sparse-LDA sub-jobs) and the
horizontal one (no DP unless its file asks)."""


def run_demo(folder: Path) -> None:
    """The demo's job files, run in ``folder`` (its own var/ and Prefect home)."""
    for name in ("demo", "jobs"):
        shutil.copytree(ROOT / name, folder / name)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PRIVREG_HOME": str(folder / "var"),
        "PREFECT_HOME": str(folder / "prefect"),
    }
    for job in JOBS:
        subprocess.run(
            [sys.executable, "-m", "flows.pipeline", f"jobs/{job}"],
            cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip


def night_charges(folder: Path) -> list[tuple[str, str, list[Charge], float, float]]:
    """Per protected table: (database, table, one night's charges, owner's epsilon, delta)."""
    found = []
    for database in sorted(folder.glob("var/**/*.duckdb")):
        ledger = PrivacyLedger(PartyStore(str(database)))
        for table in ledger.budgets():
            charges = ledger.charges(table)
            if not charges:
                continue
            status = ledger.status(table)
            found.append((database.stem, table, charges, status.epsilon_total, status.delta_total))
    return found


def nights_that_fit(charges: list[Charge], budget: float, delta: float, composed: bool) -> int:
    """How many whole nights fit the owner's budget (at most 365)."""
    night = Counter(charges)
    figure = composed_epsilon if composed else basic_epsilon
    nights = 0
    while nights < 365:
        total = Counter({c: n * (nights + 1) for c, n in night.items()})
        if figure(list(total.elements()), delta) > budget + 1e-12:
            break
        nights += 1
    return nights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nights", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="privreg-budget-") as scratch:
        folder = Path(scratch)
        run_demo(folder)
        tables = night_charges(folder)
    print(f"\n## Privacy spent by {args.nights} nightly runs of the demo's jobs\n")
    print(
        f"| party | protected table | releases a night | owner's budget (eps, delta) | "
        f"{args.nights} nights, added up | {args.nights} nights, composed | "
        "nights that fit, added up | nights that fit, composed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for party, table, charges, budget, delta in tables:
        nights = charges * args.nights
        added, composed = basic_epsilon(nights, delta), composed_epsilon(nights, delta)
        added_text = f"{added:.3g}"
        if added == float("inf"):  # the deltas add up past the owner's: no bound at all
            spent = sum(c.epsilon for c in nights), sum(c.delta for c in nights)
            added_text = f"none (eps {spent[0]:.3g} at delta {spent[1]:.2g})"
        print(
            f"| {party} | {table} | {len(charges)} | {budget:g}, {delta:g} | {added_text} | "
            f"{composed:.3g} | {nights_that_fit(charges, budget, delta, False)} | "
            f"{nights_that_fit(charges, budget, delta, True)} |"
        )


if __name__ == "__main__":
    main()
