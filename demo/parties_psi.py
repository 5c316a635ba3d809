"""The demo's PSI stage with each party its own OS process, talking over mutual TLS on loopback.

For each of the demo's two organisations (the clinic and the lab) this creates a folder
``var/orgs/<party>/`` with its own database, certificate, key and ``party.toml``, starts its
message endpoint (``privreg party serve``) and runs its side of ``psi_align``
(``privreg party psi``) with its own Prefect home. Neither process is given the other's path.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from privreg.cli import main as privreg

ROOT = Path(__file__).resolve().parents[1]
JOB = json.loads((ROOT / "jobs" / "demo.json").read_text())
ORGS = ROOT / "var" / "orgs"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(role: str, ports: dict[str, int], ca: Path) -> tuple[str, Path, dict]:
    spec = JOB["parties"][role]
    party = spec["table"]["party"]
    folder = ORGS / party
    table = {**spec["table"], "database": str(folder / f"{party}.duckdb")}
    args = ["load", str(ROOT / spec["source"]), "--database", table["database"]]
    args += ["--table", table["table"], "--party", party, "--id-column", table["id_column"]]
    if table.get("label_column"):
        args += ["--label-column", table["label_column"]]
    if table.get("label_domain"):
        args += ["--label-domain", ",".join(str(v) for v in table["label_domain"])]
    privreg(args)
    privreg(["certs", "issue", "--ca", str(ca), "--party", party, "--out", str(folder)])
    peer = next(p for p in ports if p != party)
    config = folder / "party.toml"
    config.write_text(
        f'party = "{party}"\nroot = "home"\nlisten = "127.0.0.1:{ports[party]}"\n'
        f'receive_timeout = 300\n\n[tls]\nca = "{ca / "ca.pem"}"\n'
        f'cert = "{party}.pem"\nkey = "{party}.key"\n\n[peers]\n'
        f'{peer} = "127.0.0.1:{ports[peer]}"\n'
    )
    return party, config, table


def main() -> None:
    shutil.rmtree(ORGS, ignore_errors=True)  # a fresh demo: new keys, new job
    ca = ORGS / "ca"
    privreg(["certs", "init", "--out", str(ca)])
    names = [JOB["parties"][role]["table"]["party"] for role in ("guest", "host")]
    ports = {name: free_port() for name in names}
    parties = [prepare(role, ports, ca) for role in ("guest", "host")]
    cli = [sys.executable, "-m", "privreg.cli", "party"]

    def env(folder: Path) -> dict[str, str]:
        own = {k: v for k, v in os.environ.items() if not k.startswith("PRIVREG_")}
        return {**own, "PREFECT_HOME": str(folder / "prefect"), "GRPC_VERBOSITY": "NONE"}

    def side(peer: str) -> list[str]:
        return ["--peer", peer, "--job", "demo-psi", "--min-rows", str(JOB["psi"]["min_rows"])]

    servers = []
    try:
        for _, config, _ in parties:
            server = subprocess.Popen(
                [*cli, "serve", "--config", str(config)],
                cwd=config.parent,
                env=env(config.parent),
                stdout=subprocess.PIPE,
                text=True,
            )
            servers.append(server)
            print(server.stdout.readline().strip())
        runs = [
            subprocess.Popen(
                [*cli, "psi", "--config", str(config), "--table", json.dumps(table), *side(peer)],
                cwd=config.parent,
                env=env(config.parent),
                stdout=subprocess.PIPE,
                text=True,
            )
            for (_, config, table), (peer, _, _) in zip(parties, parties[::-1], strict=True)
        ]
        for (party, _, _), run in zip(parties, runs, strict=True):
            out, _ = run.communicate(timeout=600)
            if run.returncode:
                raise SystemExit(f"{party}'s PSI run failed (exit {run.returncode})")
            print(f"{party}: {out.strip().splitlines()[-1]}")
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    main()
