"""The data owner stays in charge: budgets and permissions live in its store, set by its CLI.

Each test plays the flow's caller (or a peer) trying to spend, raise or bypass what the owner
decided, against the real task and storage functions, and checks the refusal names the party
and table and that nothing was charged or changed.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from prefect.logging import disable_run_logger

from core import psi
from federation.workspace import channel_for
from privreg.cli import main as cli
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import BudgetError, PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy, PolicyError
from storage.secrets import SealedArtifacts
from tasks import psi as psi_steps
from tasks.loading import load_table
from tasks.sparse_lda import SparseLDAJob
from tasks.sparse_lda_party import Site, join_job, send_rows_not_private

ROOT = Path(__file__).resolve().parents[1]


def _side(ref: TableRef, job: str, root: Path) -> psi_steps.PsiSide:
    """The clinic's side of PSI job ``job`` against the shop, over the folder ``root``."""
    return psi_steps.PsiSide(ref, "shop", channel_for(job, str(root)).endpoint(ref.party))


def owner(tmp_path: Path, table: str = "patients") -> tuple[PartyStore, TableRef]:
    ref = TableRef(str(tmp_path / "parties" / "clinic.duckdb"), table, label_column="y",
                   party="clinic")  # fmt: skip
    store = PartyStore.of(ref)
    frame = pd.DataFrame({"id": range(6), "y": [0, 1] * 3, "x": np.arange(6.0)})
    store.import_frame(frame, ref)
    return store, ref


# ---- item 4: budgets belong to the owner ------------------------------------------------------
def test_a_job_file_cannot_raise_or_reset_an_exhausted_budget(tmp_path: Path) -> None:
    store, ref = owner(tmp_path)
    source = tmp_path / "clinic.csv"
    store.read_table(ref).to_csv(source, index=False)
    with disable_run_logger():
        load_table.fn(str(source), ref, {"epsilon": 1.0, "delta": 0.0})  # first load: initial
    ledger = PrivacyLedger(store)
    ledger.charge_and_store("r1", "patients", 1.0, 0.0, "test", "job", [1])
    with disable_run_logger():  # the next run's job file claims a fresh, larger budget
        load_table.fn(str(source), ref, {"epsilon": 100.0, "delta": 0.5})
    status = ledger.status("patients")
    assert (status.epsilon_total, status.epsilon_left) == (1.0, 0.0)
    with pytest.raises(BudgetError, match=r"exceeds the budget"):
        ledger.charge_and_store("r2", "patients", 0.1, 0.0, "test", "job", [2])
    assert cli(["budget", "set", "--database", ref.database, "--table", "patients",
                "--epsilon", "3"]) == 0  # fmt: skip
    assert ledger.status("patients").epsilon_left == pytest.approx(2.0)  # spends stay


def test_an_aligned_copy_charges_its_source_tables_budget(tmp_path: Path) -> None:
    store, ref = owner(tmp_path)
    frame = store.read_table(ref)
    # two PSI alignments with different peers write two copies of the same rows
    for copy in ("patients_aligned", "patients_aligned_b"):
        with store.transaction() as con:
            store.write_table(copy, frame, con)
            OwnerPolicy(store).record_source(copy, "patients", con)
    ledger = PrivacyLedger(store)
    ledger.set_budget("patients", 1.0, 0.0)
    with pytest.raises(PolicyError, match=r"copy of 'patients'"):
        ledger.set_budget("patients_aligned", 50.0, 0.0)  # a copy has no budget of its own
    ledger.charge_and_store("a", "patients_aligned", 0.7, 0.0, "test", "job", [1])
    with pytest.raises(BudgetError, match=r"copy of 'patients'\): .* exceeds"):
        ledger.charge_and_store("b", "patients_aligned_b", 0.7, 0.0, "test", "job", [2])
    assert ledger.status("patients").epsilon_spent == pytest.approx(0.7)
    assert [s["protected_table"] for s in ledger.spends()] == ["patients"]


def test_psi_alignment_records_the_copys_source(tmp_path: Path) -> None:
    """The real PSI step writes the lineage in the same transaction as the aligned table."""
    _, ref = owner(tmp_path)
    peer_ids = list(range(2, 9))
    key, peer_key = psi.new_key(), psi.new_key()
    artifacts = ArtifactStore(PartyStore.of(ref))
    mine = psi.prepare(list(range(6)), key)
    theirs = psi.prepare(peer_ids, peer_key)
    artifacts.put("psi/j/rows", mine.rows, "psi-state")
    artifacts.put("psi/j/peer_double", psi.reblind(theirs.blinded, key), "psi-state")
    channel_for("j", str(tmp_path)).endpoint("shop").send(
        "clinic", "psi_double", psi.reblind(mine.blinded, peer_key)
    )
    with disable_run_logger():
        psi_steps.store_aligned_rows.fn(_side(ref, "j", tmp_path), 1)
    assert PrivacyLedger(PartyStore.of(ref)).budget_table("patients_aligned") == "patients"


def test_budget_cli_refuses_unknown_tables_and_shows_a_table(tmp_path: Path, capsys) -> None:
    store, ref = owner(tmp_path)
    before = sorted(p.name for p in store.path.parent.iterdir())
    code = cli(["budget", "set", "--database", ref.database, "--table", "nope", "--epsilon", "9"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "no table 'nope'" in err
    assert PrivacyLedger(store).budgets() == []
    assert sorted(p.name for p in store.path.parent.iterdir()) == before
    assert cli(["budget", "set", "--database", ref.database, "--table", "patients",
                "--epsilon", "2", "--delta", "1e-6"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["protected_table", "epsilon_total", "epsilon_spent"]
    assert out.splitlines()[1].split()[:2] == ["patients", "2"]
    assert cli(["budget", "show", "--database", ref.database, "--json"]) == 0
    assert '"epsilon_total": 2.0' in capsys.readouterr().out
    assert cli(["policy", "set", "--database", ref.database, "--table", "nope",
                "--allow-raw-export"]) == 1  # fmt: skip
    assert OwnerPolicy(store).get("nope").allow_raw_export is False


# ---- item 4: options that give up privacy need the owner's permission ------------------------
def test_raw_rows_and_noiseless_releases_need_the_owners_policy(tmp_path: Path) -> None:
    _, ref = owner(tmp_path)
    base = dict(job_id="lda", parties=("clinic",), epsilon=1.0, delta=1e-6,
                direction_clip_norm=1.0, mean_clip_norm=1.0, threshold=1)  # fmt: skip
    endpoint = channel_for("lda", str(tmp_path)).endpoint(ref.party)
    pooled = Site(ref, SparseLDAJob(method="centralized_reference", **base), endpoint)
    exact = Site(ref, SparseLDAJob(method="debiased", noise_disabled_for_testing=True, **base),
                 endpoint)  # fmt: skip
    with pytest.raises(PolicyError, match=r"clinic refuses sending its raw rows .*'patients'"):
        join_job.fn(pooled)
    with pytest.raises(PolicyError, match=r"clinic refuses sending its raw rows .*'patients'"):
        send_rows_not_private.fn(pooled, ["x"])
    with pytest.raises(PolicyError, match=r"clinic refuses a release without noise"):
        join_job.fn(exact)
    assert endpoint.channel.log() == []  # nothing was sent
    assert cli(["policy", "set", "--database", ref.database, "--table", "patients",
                "--allow-raw-export"]) == 0  # fmt: skip
    join_job.fn(pooled)  # now allowed: the schema goes to the coordinator
    with pytest.raises(PolicyError, match=r"without noise"):  # the other permission is still off
        join_job.fn(exact)


# ---- item 5: concurrent charges ----------------------------------------------------------------
def test_concurrent_charges_cannot_overspend(tmp_path: Path) -> None:
    store, _ = owner(tmp_path)
    ledger = PrivacyLedger(store)
    ledger.set_budget("patients", 1.0, 0.0)
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def charge(i: int) -> None:
        barrier.wait()
        try:
            PrivacyLedger(PartyStore(store.path)).charge_and_store(
                f"r{i}", "patients", 0.8, 0.0, "test", "job", [i]
            )
            outcomes.append("ok")
        except BudgetError:
            outcomes.append("refused")

    threads = [threading.Thread(target=charge, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["ok", "refused", "refused", "refused"]
    assert ledger.status("patients").epsilon_spent == pytest.approx(0.8)


def test_concurrent_charges_from_processes_cannot_overspend(tmp_path: Path) -> None:
    store, _ = owner(tmp_path)
    PrivacyLedger(store).set_budget("patients", 1.0, 0.0)
    script = (
        "import sys\n"
        "from storage.ledger import BudgetError, PrivacyLedger\n"
        "from storage.party_store import PartyStore\n"
        "try:\n"
        f"    PrivacyLedger(PartyStore({str(store.path)!r})).charge_and_store(\n"
        "        sys.argv[1], 'patients', 0.8, 0.0, 'test', 'job', [1])\n"
        "    print('ok')\n"
        "except BudgetError:\n"
        "    print('refused')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, f"p{i}"], env=env, stdout=subprocess.PIPE, text=True
        )
        for i in range(3)
    ]
    outcomes = sorted(p.communicate(timeout=120)[0].strip() for p in processes)
    assert outcomes == ["ok", "refused", "refused"]
    assert PrivacyLedger(store).status("patients").epsilon_spent == pytest.approx(0.8)


# ---- item 6: files readable by their owner only ------------------------------------------------
def test_party_databases_are_private_to_their_owner(tmp_path: Path) -> None:
    store, _ = owner(tmp_path)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700  # created by privreg
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    PartyStore(shared / "x.duckdb").write_table("t", pd.DataFrame({"a": [1]}))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # an existing folder is left alone
    assert stat.S_IMODE((shared / "x.duckdb").stat().st_mode) == 0o600


# ---- item 9: PSI refuses a peer's repeated or malformed points --------------------------------
def test_psi_refuses_repeated_and_malformed_points_naming_the_peer(tmp_path: Path) -> None:
    key = psi.new_key()
    honest = psi.prepare(["a", "b", "c"], psi.new_key()).blinded
    repeated = np.vstack([honest, honest[1:2]])
    with pytest.raises(psi.PsiError, match=r"from shop repeats the point at position 1"):
        psi.reblind(repeated, key, peer="shop")
    with pytest.raises(psi.PsiError, match=r"from shop is malformed"):
        psi.reblind(honest[:, :16], key, peer="shop")
    with pytest.raises(psi.PsiError, match=r"from shop is malformed"):
        psi.reblind(honest.astype(np.int64), key, peer="shop")
    own = psi.prepare(["a", "b"], key)
    with pytest.raises(psi.PsiError, match=r"answer from shop repeats"):
        psi.intersect(np.vstack([honest[:1], honest[:1]]), own.rows, honest, peer="shop")
    # through the real task: the peer's message is refused before anything is stored
    _, ref = owner(tmp_path)
    SealedArtifacts(PartyStore.of(ref), "psi/j2").put("psi/j2/key", key)  # as blind_own_ids
    channel_for("j2", str(tmp_path)).endpoint("shop").send("clinic", "psi_blinded", repeated)
    with pytest.raises(psi.PsiError, match=r"shop repeats"):
        psi_steps.blind_peer_ids.fn(_side(ref, "j2", tmp_path))
    assert ArtifactStore(PartyStore.of(ref)).get("psi/j2/peer_double") is None
