"""PSI with each party its own OS process, own folder and database, talking over mTLS gRPC.

Each party gets only its own configuration file (its folder, key, certificate, the CA and its
peer's address); the result must be the alignment the one-process flow computes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import party_env

from demo.orgs import free_port
from flows.align import psi_align
from privreg.cli import main as privreg
from storage.descriptor import TableRef
from storage.party_store import PartyStore

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop")


def make_tables(folder: Path) -> tuple[TableRef, TableRef, set[str]]:
    rng = np.random.default_rng(11)
    ids = [f"c-{rng.integers(10**9)}-{i}" for i in range(260)]
    bank_ids, shop_ids = ids[:200], ids[:140] + ids[200:]
    bank = TableRef(database=str(folder / "bank" / "bank.duckdb"), table="accounts")
    shop = TableRef(database=str(folder / "shop" / "shop.duckdb"), table="orders")
    PartyStore.of(bank).import_frame(
        pd.DataFrame({"id": bank_ids, "balance": rng.normal(size=200)}), bank
    )
    PartyStore.of(shop).import_frame(
        pd.DataFrame({"id": shop_ids[::-1], "spend": rng.normal(size=200)}), shop
    )
    return bank, shop, set(bank_ids) & set(shop_ids)


def write_config(folder: Path, party: str, ports: dict[str, int], certs: Path) -> Path:
    peer = next(p for p in PARTIES if p != party)
    path = folder / party / "party.toml"
    path.write_text(
        f'party = "{party}"\nroot = "home"\nlisten = "127.0.0.1:{ports[party]}"\n'
        "receive_timeout = 60\n\n[tls]\n"
        f'ca = "{certs / "ca.pem"}"\ncert = "{certs / party}.pem"\nkey = "{certs / party}.key"\n'
        f'\n[peers]\n{peer} = "127.0.0.1:{ports[peer]}"\n'
    )
    return path


def aligned(ref: TableRef, table: str) -> pd.DataFrame:
    return PartyStore.of(ref).read_table(ref.with_table(table))


def test_two_party_processes_align_like_one_process(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    bank1, shop1, expected = make_tables(one)
    reference = psi_align(bank1.to_dict(), shop1.to_dict(), min_rows=100, workspace=str(one))

    bank, shop, _ = make_tables(two)
    certs = two / "ca-admin"
    assert privreg(["certs", "init", "--out", str(certs)]) == 0
    for party in PARTIES:
        assert (
            privreg(["certs", "issue", "--ca", str(certs), "--party", party, "--out", str(certs)])
            == 0
        )
        assert (certs / f"{party}.key").stat().st_mode & 0o777 == 0o600
    ports = {party: free_port() for party in PARTIES}
    configs = {party: write_config(two, party, ports, certs) for party in PARTIES}
    cli = [sys.executable, "-m", "privreg.cli", "party"]
    servers = [
        subprocess.Popen(
            [*cli, "serve", "--config", str(configs[p])],
            cwd=two / p,
            env=party_env(two / p),
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in PARTIES
    ]
    runs: list[subprocess.Popen] = []
    try:
        for server in servers:
            assert "serving its messages" in server.stdout.readline()
        refs = {"bank": bank, "shop": shop}

        def both(job: str, *options: str) -> list[tuple[str, str]]:
            args = {
                p: ["--config", str(configs[p]), "--table", json.dumps(refs[p].to_dict())]
                for p in refs
            }
            started = [
                subprocess.Popen(
                    [*cli, "psi", *args[party], "--peer", peer, "--job", job, *options],
                    cwd=two / party,
                    env=party_env(two / party),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for party, peer in (("bank", "shop"), ("shop", "bank"))
            ]
            runs.extend(started)
            deadline = time.monotonic() + 180
            done = [run.communicate(timeout=max(deadline - time.monotonic(), 1)) for run in started]
            for run, (_, err) in zip(started, done, strict=True):
                assert run.returncode == 0, err[-3000:]
            return done

        outputs = both("psi-two-processes")
        counted = both("psi-count-two-processes", "--count-only")  # cardinality only
    finally:
        for process in [*runs, *servers]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    counts = [json.loads(out.strip().splitlines()[-1]) for out, _ in counted]
    assert [c["intersection_size"] for c in counts] == [140, 140]
    assert all("aligned" not in c for c in counts)  # no rows: no table written
    assert [r["intersection_size"] for r in results] == [len(expected)] * 2 == [140] * 2
    assert results[0]["set_sizes"] == reference["set_sizes"] == [200, 200]

    two_bank, two_shop = aligned(bank, "accounts_aligned"), aligned(shop, "orders_aligned")
    assert two_bank["id"].tolist() == two_shop["id"].tolist()  # same order on both sides
    for two_side, one_ref, one_table in (
        (two_bank, bank1, reference["aligned"][0]["table"]),
        (two_shop, shop1, reference["aligned"][1]["table"]),
    ):
        one_side = aligned(one_ref, one_table)
        pd.testing.assert_frame_equal(
            two_side.sort_values("id").reset_index(drop=True),
            one_side.sort_values("id").reset_index(drop=True),
        )
    # each party's folder holds only the messages it sent or received
    for party in PARTIES:
        files = [f for f in (two / party / "home" / "runs").rglob("r*/*__*") if f.is_file()]
        assert files and all(party in f.name.split("__")[:2] for f in files)
