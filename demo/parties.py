"""The demo's PSI and vertical LR with each organisation its own OS process, over mTLS on loopback.

Three organisations, each with a folder ``var/orgs/<party>/`` holding its own database,
certificate, key, ``party.toml`` and Prefect home: the clinic (the guest: diagnoses and
measurements), the lab (the host: other measurements) and an arbiter (holds the Paillier key).
Each starts its message endpoint (``privreg party serve``); the clinic and the lab align their
tables (``privreg party psi``); then all three train (``privreg party vertical``), each given
only its own configuration and, for the clinic and the lab, its own aligned table. Every
party prints its own result line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.orgs import Org, make_orgs, serve, start
from privreg.cli import main as privreg

ROOT = Path(__file__).resolve().parents[1]
JOB = json.loads((ROOT / "jobs" / "demo.json").read_text())
ORGS = ROOT / "var" / "orgs"
ARBITER = "arbiter"


def load(org: Org, role: str) -> dict[str, Any]:
    """The party's source file, into its own database (as ``privreg load`` does for anyone)."""
    spec = JOB["parties"][role]
    table = {**spec["table"], "database": str(org.folder / f"{org.party}.duckdb")}
    args = ["load", str(ROOT / spec["source"]), "--database", table["database"]]
    args += ["--table", table["table"], "--party", org.party, "--id-column", table["id_column"]]
    if table.get("label_column"):
        args += ["--label-column", table["label_column"]]
    if table.get("label_domain"):
        args += ["--label-domain", ",".join(str(v) for v in table["label_domain"])]
    privreg(args)
    return table


def finish(runs: dict[str, subprocess.Popen], what: str) -> dict[str, dict[str, Any]]:
    results = {}
    for party, run in runs.items():
        out, _ = run.communicate(timeout=1800)
        if run.returncode:
            raise SystemExit(f"{party}'s {what} run failed (exit {run.returncode})")
        results[party] = json.loads(out.strip().splitlines()[-1])
    return results


def main() -> None:
    shutil.rmtree(ORGS, ignore_errors=True)  # a fresh demo: new keys, new jobs
    guest, host = (JOB["parties"][role]["table"]["party"] for role in ("guest", "host"))
    orgs = make_orgs(ORGS, [guest, host, ARBITER])
    tables = {guest: load(orgs[guest], "guest"), host: load(orgs[host], "host")}
    servers = [serve(org) for org in orgs.values()]
    try:
        psi_args = ["--job", "demo-psi", "--min-rows", str(JOB["psi"]["min_rows"])]
        psi = finish(
            {
                party: start(
                    orgs[party],
                    "psi",
                    [*psi_args, "--table", json.dumps(tables[party]), "--peer", peer],
                )
                for party, peer in ((guest, host), (host, guest))
            },
            "PSI",
        )
        for party, result in psi.items():
            print(f"{party} (psi): {result['intersection_size']} shared rows")
        shared = ["--job", "demo-vertical", "--guest", guest, "--hosts", host, "--arbiter", ARBITER]
        shared += ["--options", json.dumps(JOB["vertical"])]
        roles = {guest: "guest", host: "host", ARBITER: "arbiter"}
        vertical = finish(
            {
                party: start(
                    orgs[party],
                    "vertical",
                    [*shared, "--role", role]
                    + (["--table", json.dumps(psi[party]["aligned"])] if party in psi else []),
                )
                for party, role in roles.items()
            },
            "vertical LR",
        )
        for party, result in vertical.items():
            line = {k: v for k, v in result.items() if k not in ("losses", "database")}
            print(f"{party} (vertical_lr, {roles[party]}): {json.dumps(line)}")
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    main()
