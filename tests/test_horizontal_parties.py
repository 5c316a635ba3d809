"""Horizontal LR with every hospital and the coordinator its own OS process, over mTLS gRPC.

Each process is given only its own party configuration (its folder, key, certificate, the CA
and its peers' addresses) and, for a hospital, its own database. The parties' message
endpoints are served from this test process (as ``privreg party serve`` would), so a party's
flow process can be killed while what it already sent stays fetchable, or be stopped too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pandas as pd
import pytest
from helpers import chart_images
from prefect.settings import PREFECT_API_URL
from prefect_api import run_artifacts, run_logs
from sklearn.metrics import log_loss

from core import horizontal_lr as hlr
from core.preprocessing import FittedPreprocessing
from core.test_switches import PARTY_FAULT_VARIABLE
from demo.orgs import free_port
from federation import certs
from federation.party_config import PartyConfig
from federation.transport_grpc import serve
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks.summaries import holdout_split

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
LR, L2 = 0.5, 1e-3
COORDINATOR = "coordinator"


class Job:
    """Certificates, configurations, databases and message endpoints of one multi-process job."""

    def __init__(self, folder: Path, hospitals: list[str], rows: int = 40) -> None:
        self.folder, self.hospitals = folder, hospitals
        everyone = [COORDINATOR, *hospitals]
        ca = certs.create_ca(folder / "ca")
        ports = {p: free_port() for p in everyone}
        self.configs: dict[str, Path] = {}
        self.servers: dict[str, grpc.Server] = {}
        for party in everyone:
            issued = certs.issue(ca, party, folder / "certs")
            home = folder / party
            home.mkdir()
            peers = "".join(f'{p} = "127.0.0.1:{ports[p]}"\n' for p in everyone if p != party)
            path = home / "party.toml"
            path.write_text(
                f'party = "{party}"\nroot = "home"\nlisten = "127.0.0.1:{ports[party]}"\n'
                f'receive_timeout = 90\n\n[tls]\nca = "{ca.cert}"\ncert = "{issued.cert}"\n'
                f'key = "{issued.key}"\n\n[peers]\n{peers}'
            )
            self.configs[party] = path
            self.servers[party], _ = serve(PartyConfig.load(path), max_workers=4)
        rng = np.random.default_rng(5)
        true = np.array([1.5, -2.0, 0.5, 0.8])
        self.refs: dict[str, TableRef] = {}
        self.arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for i, name in enumerate(hospitals):
            X = rng.normal(loc=0.1 * i, size=(rows + 7 * i, 4))
            y = (rng.random(len(X)) < 1 / (1 + np.exp(-X @ true))).astype(int)
            frame = pd.DataFrame(X, columns=["age", "bmi", "dose", "score"])
            frame.insert(0, "diagnosis", y)
            frame.insert(0, "patient_id", [f"{name}-{r}" for r in range(len(X))])
            ref = TableRef(
                database=str(folder / name / f"{name}.duckdb"),
                table="patients",
                id_column="patient_id",
                label_column="diagnosis",
                label_domain=(0, 1),
            )
            PartyStore.of(ref).write_table(ref.table, frame)
            self.refs[name], self.arrays[name] = ref, (X, y.astype(np.float64))
        self.runs: dict[str, subprocess.Popen[str]] = {}

    def start(self, party: str, job: str, *extra: str, fault: str | None = None) -> None:
        """The party's process; ``fault`` ("<round>:<stage>:kill|raise") is the test switch of
        its environment for ``job``."""
        command = [sys.executable, "-m", "privreg.cli", "party", "horizontal"]
        command += ["--config", str(self.configs[party]), "--job", job]
        command += ["--parties", ",".join(self.hospitals), "--learning-rate", str(LR)]
        command += ["--l2", str(L2), "--join-timeout", "120", *extra]
        if party != COORDINATOR:
            command += ["--table", json.dumps(self.refs[party].to_dict())]
        from prefect.settings import PREFECT_API_URL

        env = {k: v for k, v in os.environ.items() if not k.startswith("PRIVREG_")}
        env.update(
            PYTHONPATH=str(ROOT),
            PREFECT_API_URL=str(PREFECT_API_URL.value()),
            PREFECT_HOME=str(self.folder / party / "prefect"),
            GRPC_VERBOSITY="NONE",
        )
        if fault is not None:
            env[PARTY_FAULT_VARIABLE] = f"{job}:{fault}"
        self.runs[party] = subprocess.Popen(
            command,
            cwd=self.folder / party,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finish(self, party: str, timeout: float = 240) -> tuple[int, str, str]:
        out, err = self.runs[party].communicate(timeout=timeout)
        return self.runs[party].returncode, out, err

    def result(self, party: str) -> dict[str, Any]:
        code, out, err = self.finish(party)
        assert code == 0, f"{party} failed:\n{err[-3000:]}"
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        for run in self.runs.values():
            if run.poll() is None:
                run.kill()
                run.communicate(timeout=30)
        for server in self.servers.values():
            server.stop(None)


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(hospitals: list[str]) -> Job:
        jobs.append(Job(tmp_path, hospitals))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def scaled(job: Job, coordinator: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each hospital's rows as it trains on them: the job's pooled statistics applied."""
    fitted = FittedPreprocessing.from_dict(coordinator["preprocessing"])
    return {h: (fitted.transform(X), y) for h, (X, y) in job.arrays.items()}


def reference(
    job: Job, survivors_per_round: list[list[str]], coordinator: dict[str, Any]
) -> np.ndarray:
    """Plaintext full-batch GD on the pooled rows of each round's survivors."""
    weights = hlr.init_model(4)
    arrays = scaled(job, coordinator)
    for survivors in survivors_per_round:
        X = np.vstack([arrays[p][0] for p in survivors])
        y = np.concatenate([arrays[p][1] for p in survivors])
        weights = hlr.apply_mean_gradient(weights, hlr.gradient(weights, X, y, L2), LR)
    return weights


def test_hospital_processes_train_the_plaintext_model_across_a_restart(make_job: Any) -> None:
    hospitals = ["hospital_a", "hospital_b", "hospital_c"]
    job = make_job(hospitals)
    holdout = ["--holdout-fraction", "0.25"]  # each hospital's own; the coordinator's none
    for party in [COORDINATOR, *hospitals]:
        fault = "1:mask_input:kill" if party == "hospital_c" else None
        own = holdout if party != COORDINATOR else []
        job.start(party, "hlr-three", "--rounds", "2", "--tol", "0", "--stage-timeout", "90",
                  *own, fault=fault)  # fmt: skip
    # hospital_c's process dies (SIGKILL) before masking round 1 (its job keys were agreed
    # before round 0); restarted with the same command, it resumes from its own records
    # (the same keys) within the stage deadline
    assert job.finish("hospital_c")[0] == -9
    job.start("hospital_c", "hlr-three", *holdout)
    coordinator = job.result(COORDINATOR)
    parties = {h: job.result(h) for h in hospitals}

    splits = {h: holdout_split(len(job.arrays[h][1]), 0.25, "hlr-three") for h in hospitals}
    arrays = scaled(job, coordinator)
    X = np.vstack([arrays[h][0][splits[h][0]] for h in hospitals])  # training rows only
    y = np.concatenate([arrays[h][1][splits[h][0]] for h in hospitals])
    reference = hlr.centralized_gd(X, y, L2, LR, 2)
    np.testing.assert_allclose(coordinator["weights"], reference, rtol=0, atol=1e-6)
    # the uninterrupted model: every round summed all three hospitals
    assert coordinator["rounds_completed"] == 2 and coordinator["dropped"] == [[], []]
    for result in parties.values():  # every hospital checked and kept the same model
        assert result["weights"] == coordinator["weights"] and result["rounds_completed"] == 2
    # each hospital's summary: its own held-out figures, as the one-process summary gives them
    for h, result in parties.items():
        X_h, y_h = arrays[h]
        train, held = splits[h]
        scores = hlr.predict_proba(reference, X_h[held])
        figures = {q["metric"]: q for q in result["quality"]}
        assert set(figures) == {f"AUC at {h}", f"log-loss at {h}"}  # no other hospital's
        loss = figures[f"log-loss at {h}"]
        assert loss["rows"] == f"{h}'s {held.size} held-out rows"
        assert loss["model"] == pytest.approx(log_loss(y_h[held], scores, labels=[0, 1]))
        prior = np.full(held.size, y_h[train].mean())
        assert loss["baseline"] == pytest.approx(log_loss(y_h[held], prior, labels=[0, 1]))
    # each party's folder holds only messages it sent or that were addressed to it
    for party in [COORDINATOR, *hospitals]:
        files = list((job.folder / party / "home" / "runs").rglob("r*/*__*"))
        assert files and all(party in f.name.split("__")[:2] for f in files)
    # the coordinator's rounds table names the attempt that ran each round: hospital_c's
    # restart ran no round of the coordinator's, so both carry its one run's first try and
    # neither is reused (a re-run marks earlier rounds reused: test_horizontal_flow)
    env = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}
    run, published = run_artifacts(env, f"horizontal_lr hlr-three: {COORDINATOR}")
    rounds = json.loads(published["rounds"]["data"])
    assert [(r["round"], r["attempt"], r["reused"]) for r in rounds] == [
        (r, f"{run['id'][:8]} try 1", "") for r in (0, 1)
    ]
    # its KiB per round are real in party mode: its own folder's messages of each round
    assert all(r["KiB sent"] > 1 for r in rounds)
    # its chart: the aggregated loss per round (it holds no labels); each hospital's: its ROC
    (loss,) = chart_images(published["charts"]["data"])
    assert loss.startswith("<svg") and "training loss per round" in published["charts"]["data"]
    _, restarted = run_artifacts(env, "horizontal_lr hlr-three: hospital_c")
    assert "ROC, hospital_c's" in restarted["charts"]["data"]
    assert [c[:4] for c in chart_images(restarted["charts"]["data"])] == ["<svg"]
    # a hospital's fast rounds share a task run; its log still names every round it ran
    run, _ = run_artifacts(env, "horizontal_lr hlr-three: hospital_a")
    named = [m.split(": rounds ")[1].split(" ")[0] for m in run_logs(env, run["id"])
             if m.startswith("hospital_a: rounds ")]  # fmt: skip
    ran = [r for span in named for r in range(int(span.split("-")[0]), int(span.split("-")[1]) + 1)]
    assert ran == [0, 1]


def test_a_killed_and_a_failing_hospital_leave_the_survivors_model(make_job: Any) -> None:
    hospitals = [f"hospital_{c}" for c in "abcde"]
    job = make_job(hospitals)
    options = ["--rounds", "4", "--tol", "0", "--threshold", "3", "--stage-timeout", "8"]
    job.start(COORDINATOR, "hlr-dropouts", *options)
    for party in hospitals:
        # the second round (index 1) and the third (index 2)
        fault = {"hospital_b": "1:mask_input:kill", "hospital_d": "2:mask_input:raise"}.get(party)
        job.start(party, "hlr-dropouts", *options, fault=fault)  # the agreed terms alike

    code, _, _ = job.finish("hospital_b")  # killed before masking in round 1: gone for good
    assert code == -9
    job.servers.pop("hospital_b").stop(None)  # and its message endpoint with it
    code, _, err = job.finish("hospital_d")
    assert code != 0 and "injected failure before mask_input in round 2" in err
    coordinator = job.result(COORDINATOR)
    survivors = {h: job.result(h) for h in ["hospital_a", "hospital_c", "hospital_e"]}

    gone = ["hospital_b", "hospital_d"]
    assert coordinator["dropped"] == [[], ["hospital_b"], gone, gone]
    # dropped stays dropped: no stage of a later round waits for a party that missed one
    assert coordinator["left_out"] == [[], [], ["hospital_b"], gone]
    per_round = [[h for h in hospitals if h not in gone] for gone in coordinator["dropped"]]
    expected = reference(job, per_round, coordinator)
    np.testing.assert_allclose(coordinator["weights"], expected, atol=1e-6)
    for result in survivors.values():
        assert result["weights"] == coordinator["weights"] and result["rounds_completed"] == 4


def test_below_the_threshold_the_coordinator_fails_naming_the_missing(make_job: Any) -> None:
    hospitals = ["hospital_a", "hospital_b", "hospital_c"]
    job = make_job(hospitals)
    options = ["--rounds", "2", "--tol", "0", "--stage-timeout", "6"]
    job.start(COORDINATOR, "hlr-too-few", *options)
    faults = {"hospital_b": "0:mask_input:raise", "hospital_c": "0:mask_input:kill"}
    for party in hospitals:
        job.start(party, "hlr-too-few", *options, fault=faults.get(party))

    code, _, err = job.finish(COORDINATOR)
    assert code != 0
    assert "round 0 of job hlr-too-few, stage mask_input: only 1 of 3 parties answered" in err
    assert "missing: hospital_b (no answer within 6 s); hospital_c (no answer within 6 s)" in err
    assert "nothing was unmasked or committed" in err
    # the survivor ends on the coordinator's failure (privreg/party_sides.py), naming it and the
    # missing hospitals, not on its own receive timeout (seconds: make bench-federation)
    code, _, err = job.finish("hospital_a", timeout=240)
    assert code != 0 and "MessageTimeoutError" not in err, err[-2000:]
    assert "party coordinator failed" in err and "missing: hospital_b" in err, err[-2000:]
