"""WALR and label DP with each party its own OS process, own folder and database, over mTLS gRPC.

In WALR the labels party is killed (SIGKILL) after it sent its release and restarted: the
budget has room for one release only, so a second charge would fail the run; every message it
sent before is re-sent byte for byte. For both flows, copies of the two parties' stores then
give the one-process flow the same stored release, and it must train the same model from it
(the noise is drawn once, by the labels party, and stored).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from helpers import party_env
from prefect.logging import disable_run_logger

from demo.orgs import free_port
from federation.channel import Channel
from federation.workspace import channel_for
from flows.label_dp import label_dp_regression
from flows.walr import walr
from privreg.cli import main as privreg
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from tasks import walr as steps

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "fate"
LABELS, FEATURES = "advertiser", "publisher"
PEER = {LABELS: FEATURES, FEATURES: LABELS}
ROWS = 150
CLI = [sys.executable, "-m", "privreg.cli", "party"]


class Parties:
    """Two organisations: certificates, one party.toml each, their message servers."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        certs = folder / "ca-admin"
        assert privreg(["certs", "init", "--out", str(certs)]) == 0
        ports = {party: free_port() for party in PEER}
        self.configs = {}
        for party, peer in PEER.items():
            assert privreg(["certs", "issue", "--ca", str(certs), "--party", party,
                            "--out", str(certs)]) == 0  # fmt: skip
            (folder / party).mkdir()
            self.configs[party] = folder / party / "party.toml"
            self.configs[party].write_text(
                f'party = "{party}"\nroot = "home"\nlisten = "127.0.0.1:{ports[party]}"\n'
                f'receive_timeout = 60\n\n[tls]\nca = "{certs / "ca.pem"}"\n'
                f'cert = "{certs / party}.pem"\nkey = "{certs / party}.key"\n\n'
                f'[peers]\n{peer} = "127.0.0.1:{ports[peer]}"\n'
            )
        self.servers = [self.start(p, ["serve"], stdout=subprocess.PIPE) for p in PEER]
        for server in self.servers:
            assert "serving its messages" in server.stdout.readline()

    def start(self, party: str, command: list[str], **pipes: Any) -> subprocess.Popen:
        if command[0] != "serve":
            pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        return subprocess.Popen(
            [*CLI, command[0], "--config", str(self.configs[party]), *command[1:]],
            cwd=self.folder / party,
            env=party_env(self.folder / party),
            text=True,
            **pipes,
        )

    def run(self, protocol: str, job: str, tables: dict[str, TableRef], options: dict[str, list],
            evaluate: dict[str, bool]) -> dict[str, subprocess.Popen]:  # fmt: skip
        """Start both parties' side of ``job``; each gets only its own table and options."""
        runs = {}
        for party, ref in tables.items():
            role = "labels" if party == LABELS else "features"
            command = [protocol, "--table", json.dumps(ref.to_dict()), "--role", role,
                       "--peer", PEER[party], "--job", job, *options[party]]  # fmt: skip
            runs[party] = self.start(party, command + ["--evaluate"] * evaluate[party])
        return runs

    def message(self, party: str, job: str, kind: str) -> Path:
        name = f"{party}__{PEER[party]}__{kind}"
        return self.folder / party / "home" / "runs" / job / "messages" / "r000000" / name

    def sent(self, party: str, job: str) -> dict[str, str]:
        """SHA-256 of every message ``party`` sent in ``job``."""
        folder = self.message(party, job, "x").parent
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob(f"{party}__*")
        }

    def close(self) -> None:
        for server in self.servers:
            server.terminate()
            server.wait(timeout=10)


@pytest.fixture(scope="module")
def parties(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parties]:
    organisations = Parties(tmp_path_factory.mktemp("organisations"))
    yield organisations
    organisations.close()


def finish(runs: dict[str, subprocess.Popen], timeout: float = 120) -> dict[str, dict[str, Any]]:
    deadline, results = time.monotonic() + timeout, {}
    try:
        for party, run in runs.items():
            out, err = run.communicate(timeout=max(deadline - time.monotonic(), 1))
            assert run.returncode == 0, f"{party}: {err[-3000:]}"
            results[party] = json.loads(out.strip().splitlines()[-1])
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    return results


def kill_after(run: subprocess.Popen, sent: Path, timeout: float = 90) -> None:
    """SIGKILL ``run`` once it has sent ``sent``, while it still waits for the peer."""
    deadline = time.monotonic() + timeout
    while not sent.exists():
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{sent.name} was never sent"
        time.sleep(0.05)
    assert run.poll() is None  # waiting for predictions its peer was not asked to send
    os.kill(run.pid, signal.SIGKILL)
    run.communicate()


def copy_stores(parties: Parties, folder: Path) -> dict[str, Path]:
    """The parties' databases as they are now, in one folder for the one-process flow."""
    folder.mkdir()
    for party in PEER:
        for path in (parties.folder / party).glob(f"{party}.duckdb*"):  # with its .secrets
            copy = shutil.copytree if path.is_dir() else shutil.copy
            copy(path, folder / path.name)
    return {party: folder / f"{party}.duckdb" for party in PEER}


def run_killing_the_labels_party(
    parties: Parties,
    protocol: str,
    job: str,
    tables: dict[str, TableRef],
    options: dict[str, list],
    release_kind: str,
) -> dict[str, dict[str, Any]]:
    """Run 1: only the labels party asks for an evaluation, so after sending its release it
    waits for predictions that never come; it is killed there, the features party finishes.
    Run 2: the labels party alone, as restarted by its operator without the evaluation; it
    must re-send exactly what it sent before. Returns the labels party's run 2 result and
    the features party's result."""
    first = parties.run(protocol, job, tables, options, {LABELS: True, FEATURES: False})
    kill_after(first[LABELS], parties.message(LABELS, job, release_kind))
    features = finish({FEATURES: first[FEATURES]})[FEATURES]
    before = parties.sent(LABELS, job)
    assert f"{LABELS}__{FEATURES}__{release_kind}" in before
    labels = finish(parties.run(protocol, job, {LABELS: tables[LABELS]}, options, {LABELS: False}))
    assert parties.sent(LABELS, job) == before  # the same bytes, nothing new
    return {**labels, FEATURES: features}


def walr_tables(folders: dict[str, Path]) -> dict[str, TableRef]:
    """The advertiser's labels (y of breast's guest), the publisher's 20 features (its host)."""
    guest = pd.read_csv(DATA / "breast_hetero_guest.csv.gz").head(ROWS)
    host = pd.read_csv(DATA / "breast_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    tables = {
        LABELS: TableRef(
            str(folders[LABELS] / f"{LABELS}.duckdb"), "conversions", label_column="y"
        ),
        FEATURES: TableRef(str(folders[FEATURES] / f"{FEATURES}.duckdb"), "impressions"),
    }
    PartyStore.of(tables[LABELS]).import_frame(guest, tables[LABELS])
    PartyStore.of(tables[FEATURES]).import_frame(host.reset_index(), tables[FEATURES])
    return tables


def test_walr_retried_randomised_steps_resend_the_same_bytes(workspace: Path) -> None:
    """A retried encryption or masking keeps what was sent (a fresh one would be refused)."""
    tables = walr_tables(dict.fromkeys(PEER, workspace))
    job = steps.WalrJob(
        job_id="walr-retried", channel=Channel(workspace, "walr-retried"), features_party=FEATURES,
        labels_party=LABELS, epsilon=1.0, delta=1e-4, mode="clipped", clip_norm=5.0,
        protected_table="conversions", labels_fingerprint="l", features_fingerprint="f",
        columns=20, key_size=1024,
    )  # fmt: skip
    channel = channel_for(job.job_id, str(workspace))
    sent = []
    with disable_run_logger():
        for _ in range(2):
            steps.encrypt_labels.fn(job, tables[LABELS])
            steps.masked_sums.fn(job, tables[FEATURES])
            sent.append({r.kind: r.sha256 for r in channel.log()})
    assert sent[0] == sent[1] and len(sent[0]) == 3  # key, [[y]], masked sums
    masks = ArtifactStore(PartyStore.of(tables[FEATURES])).list(f"walr/{job.job_id}/mask/")
    assert len(masks) == 1  # the retry computed no second mask


def test_walr_parties_as_processes_release_once_and_match_one_process(
    parties: Parties, tmp_path: Path
) -> None:
    tables = walr_tables({party: parties.folder / party for party in PEER})
    # room for exactly one release: a second charge would be refused and fail the run
    PrivacyLedger(PartyStore.of(tables[LABELS])).set_budget("conversions", 1.0, 1e-4)
    shared = ["--epsilon", "1", "--delta", "1e-4", "--clip-norm", "5", "--l2", "0.01"]
    key = ["--key-size", "1024"]  # both check the same terms (each opted into small keys)
    options = {LABELS: [*shared, *key], FEATURES: [*shared, *key]}
    job = "walr-two-processes"
    result = run_killing_the_labels_party(parties, "walr", job, tables, options, "walr_release")
    labels, features = result[LABELS], result[FEATURES]
    assert labels["reused_release"] and labels["release_job_id"] == job
    ledger = PrivacyLedger(PartyStore.of(tables[LABELS]))
    assert len(ledger.spends("conversions")) == 1  # charged once, by the killed process
    once = ledger.status("conversions").epsilon_spent  # composed at the owner's delta
    assert labels["budget"]["epsilon_spent"] == pytest.approx(once) and 0 < once <= 1.0
    assert "coefficients" not in labels and "budget" not in features

    # the one-process flow, given the same stored state, sends the same release bytes and
    # trains the same model
    stores = copy_stores(parties, tmp_path / "one")
    one = walr(
        TableRef(str(stores[FEATURES]), "impressions").to_dict(),
        TableRef(str(stores[LABELS]), "conversions", label_column="y").to_dict(),
        epsilon=1.0, delta=1e-4, clip_norm=5.0, l2=0.01, key_size=1024,
        workspace=str(tmp_path / "one"), job_id=job,
    )  # fmt: skip
    assert one["reused_release"] and one["release_job_id"] == job
    assert one["noisy_sum"] == features["noisy_sum"]
    assert one["coefficients"] == features["coefficients"]
    assert one["intercept"] == features["intercept"]
    channel = channel_for(job, str(tmp_path / "one"))
    sent = next(r for r in channel.log() if r.kind == "walr_release")
    party_bytes = parties.message(LABELS, job, "walr_release").read_bytes()
    assert sent.sha256 == hashlib.sha256(party_bytes).hexdigest()


def test_walr_parties_hold_out_and_score_the_rows_the_one_process_flow_does(
    parties: Parties, tmp_path: Path
) -> None:
    tables = walr_tables({party: parties.folder / party for party in PEER})
    PrivacyLedger(PartyStore.of(tables[LABELS])).set_budget("conversions", 5.0, 1e-3)
    shared = ["--epsilon", "1", "--delta", "1e-4", "--clip-norm", "5", "--l2", "0.01",
              "--holdout-fraction", "0.2"]  # fmt: skip
    key = ["--key-size", "1024"]  # both check the same terms (each opted into small keys)
    options = {LABELS: [*shared, *key], FEATURES: [*shared, *key]}
    job = "walr-held-out"
    # no --evaluate: the hold-out alone makes the features party score the held-out rows
    result = finish(parties.run("walr", job, tables, options, dict.fromkeys(PEER, False)))
    labels, features = result[LABELS], result[FEATURES]
    assert labels["metrics"]["scope"] == f"{round(0.2 * ROWS)} held-out rows"
    assert not labels["reused_release"] and "metrics" not in features

    stores = copy_stores(parties, tmp_path / "one")
    one = walr(
        TableRef(str(stores[FEATURES]), "impressions").to_dict(),
        TableRef(str(stores[LABELS]), "conversions", label_column="y").to_dict(),
        epsilon=1.0, delta=1e-4, clip_norm=5.0, l2=0.01, key_size=1024,
        workspace=str(tmp_path / "one"), job_id=job,
        holdout_fraction=0.2,
    )  # fmt: skip
    assert one["reused_release"] and one["coefficients"] == features["coefficients"]
    assert one["metrics"] == labels["metrics"]  # the same rows held out, scored the same


def test_label_dp_parties_as_processes_release_once_and_match_one_process(
    parties: Parties, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    ids = [f"p{i:04d}" for i in range(ROWS)]
    X = rng.normal(size=(ROWS, 3))
    y = np.clip(np.round(10 + 3 * X[:, 0] - 2 * X[:, 1] + rng.normal(size=ROWS)), 0, 20)
    tables = {
        LABELS: TableRef(
            str(parties.folder / LABELS / f"{LABELS}.duckdb"), "scores", label_column="y"
        ),
        FEATURES: TableRef(str(parties.folder / FEATURES / f"{FEATURES}.duckdb"), "measures"),
    }
    PartyStore.of(tables[LABELS]).import_frame(pd.DataFrame({"id": ids, "y": y}), tables[LABELS])
    frame = pd.DataFrame(X, columns=["x0", "x1", "x2"]).assign(id=ids)
    PartyStore.of(tables[FEATURES]).import_frame(frame, tables[FEATURES])
    PrivacyLedger(PartyStore.of(tables[LABELS])).set_budget("scores", 1.0, 0.0)
    options = ["--epsilon", "1", "--label-range", "0", "20", "--integer-labels"]
    job = "label-dp-two-processes"
    # both pass the job's options; the features party trains on the terms the digest binds
    runs = parties.run("label-dp", job, tables, dict.fromkeys(tables, options),
                       dict.fromkeys(PEER, True))  # fmt: skip
    result = finish(runs)
    labels, features = result[LABELS], result[FEATURES]
    assert not labels["reused"] and labels["budget"]["epsilon_spent"] == pytest.approx(1.0)
    assert labels["metrics"]["test_rows"] == round(0.2 * ROWS)  # predictions crossed
    assert len(PrivacyLedger(PartyStore.of(tables[LABELS])).spends("scores")) == 1

    stores = copy_stores(parties, tmp_path / "one")
    one = label_dp_regression(
        TableRef(str(stores[FEATURES]), "measures").to_dict(),
        TableRef(str(stores[LABELS]), "scores", label_column="y").to_dict(),
        epsilon=1.0, label_range=[0, 20], integer_labels=True, evaluate=True,
        workspace=str(tmp_path / "one"), job_id=job,
    )  # fmt: skip
    assert one["reused"] and one["release_key"] == labels["release_key"]
    assert one["coefficients"] == features["coefficients"]
    assert one["intercept"] == features["intercept"]
    assert one["metrics"]["test_mse"] == labels["metrics"]["test_mse"]
    copied = PrivacyLedger(PartyStore.of(TableRef(str(stores[LABELS]), "scores")))
    assert len(copied.spends("scores")) == 1  # reused, not charged again
    channel = channel_for(job, str(tmp_path / "one"))
    sent = next(r for r in channel.log() if r.kind == "noisy_labels")
    party_bytes = parties.message(LABELS, job, "noisy_labels").read_bytes()
    assert sent.sha256 == hashlib.sha256(party_bytes).hexdigest()
