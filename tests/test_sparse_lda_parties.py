"""Sparse LDA with every hospital and the coordinator its own OS process, over mTLS gRPC.

Each process is given only its own ``party.toml`` and, for a hospital, its own database. Four
hospitals join; one is killed (SIGKILL) for good in the middle of the secure sum, after
sharing its keys. The three survivors and the coordinator must end with, bit for bit, the
model the local run ``sparse_lda`` (the same side flows, as threads of one process) computes
on the same tables and options with that hospital silent at the same stage. The releases are
exact (the test switch ``PRIVREG_TEST_NOISELESS`` of every process names the job, and each
table's owner allows it), so equality is exact: the secure sum, the fit and the
post-processing are the same code either way, and a noisy run differs only by each party's
own noise share. The message endpoints are served from this test process (as ``privreg party
serve`` would), so the killed hospital's endpoint is stopped with it.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from test_vertical_parties import found_in, own_messages_only, table_values

from core.job_schema import SparseLDAOptions
from core.secagg.errors import ProtocolViolationError
from core.sparse_lda import ThresholdRule
from core.test_switches import FAULTS_VARIABLE, NOISELESS_VARIABLE, PARTY_FAULT_VARIABLE
from demo.orgs import make_orgs, start
from federation.party_config import PartyConfig
from federation.transport_grpc import serve
from federation.workspace import channel_for
from flows.sparse_lda import sparse_lda
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from tasks import sparse_lda as steps
from tasks.secure_sum import COORDINATOR, coordinator_store
from tasks.sparse_lda_coordinator import Coordinator, call_sum
from tasks.sparse_lda_party import Site, await_sum_call

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ["hospital_a", "hospital_b", "hospital_c", "hospital_d"]
KILLED = "hospital_d"
OPTIONS = {
    "epsilon": 1.0,
    "delta": 1e-6,
    "privacy_unit": "row",
    "row_clip_norm": 3.0,
    "method": "debiased",
    "threshold": 3,
    "holdout_fraction": 0.2,
}
PREPROCESSING = {"impute": "median"}  # every table has gaps: the pooled median fills them
MODEL = ("features", "direction", "mean_positive", "mean_negative", "support", "contributors")


def hospital_table(folder: Path, name: str) -> TableRef:
    """The demo hospital's rows in a database of its own, whose owner allows exact releases
    (hospital_d: the second half of hospital_a's demo patients, hospital_a the first), with
    missing cells in two columns."""
    ref = TableRef(
        database=str(folder / f"{name}.duckdb"),
        table="patients",
        id_column="patient_id",
        label_column="diagnosis",
        label_domain=(0, 1),
    )
    source = "hospital_a" if name == KILLED else name
    frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{source}.csv")
    if source == "hospital_a":
        half = len(frame) // 2
        frame = frame.iloc[half:] if name == KILLED else frame.iloc[:half]
    frame = frame.reset_index(drop=True)
    frame.loc[[1, 6, 11], "mean_radius"] = frame.loc[[3, 8], "mean_texture"] = np.nan
    PartyStore.of(ref).write_table(ref.table, frame)
    OwnerPolicy(PartyStore.of(ref)).set(ref.table, allow_noiseless_release=True)
    return ref


def local_run(folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The local run on the same tables, exact, the killed hospital's step failing at the same
    stage (the test switches of this process name its job; every side reads them)."""
    folder.mkdir()
    refs = [hospital_table(folder, name).to_dict() for name in HOSPITALS]
    monkeypatch.setenv(NOISELESS_VARIABLE, "slda-one")
    monkeypatch.setenv(
        FAULTS_VARIABLE, json.dumps({"slda-one": {"*:mask_input": {KILLED: "raise"}}})
    )
    return sparse_lda(
        refs,
        workspace=str(folder),
        job_id="slda-one",
        stage_timeout=10,
        preprocessing=PREPROCESSING,
        **OPTIONS,
    )


class Parties:
    """The organisations of one job: message endpoints served here, each party's flow in its
    own process, started with only its own configuration."""

    def __init__(self, folder: Path, job: str) -> None:
        from prefect.settings import PREFECT_API_URL

        self.orgs = make_orgs(folder, [COORDINATOR, *HOSPITALS], receive_timeout=120)
        self.refs = {name: hospital_table(self.orgs[name].folder, name) for name in HOSPITALS}
        self.servers = {n: serve(PartyConfig.load(o.config))[0] for n, o in self.orgs.items()}
        self.api = {"PREFECT_API_URL": str(PREFECT_API_URL.value()), NOISELESS_VARIABLE: job}
        self.job = job
        self.runs: dict[str, subprocess.Popen] = {}

    def run(self, party: str, options: dict[str, Any], fault: str | None = None) -> None:
        args = ["--job", self.job, "--parties", ",".join(HOSPITALS)]
        args += ["--options", json.dumps(options), "--preprocessing", json.dumps(PREPROCESSING)]
        if party in self.refs:
            args += ["--table", json.dumps(self.refs[party].to_dict())]
        env = {**self.api, **({PARTY_FAULT_VARIABLE: f"{self.job}:{fault}"} if fault else {})}
        with open(self.orgs[party].folder / "stderr.log", "a") as log:
            self.runs[party] = start(self.orgs[party], "sparse-lda", args, env, stderr=log)

    def finish(self, party: str, timeout: float = 300) -> tuple[int, str, str]:
        out, _ = self.runs[party].communicate(timeout=timeout)
        log = (self.orgs[party].folder / "stderr.log").read_text()
        return self.runs[party].returncode, out, log

    def result(self, party: str) -> dict[str, Any]:
        code, out, log = self.finish(party)
        assert code == 0, f"{party} failed:\n{log[-3000:]}"
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        for run in self.runs.values():
            if run.poll() is None:
                run.kill()
                run.wait(timeout=10)
        for server in self.servers.values():
            server.stop(grace=0).wait()


def prefect_records(job: str, folder: Path) -> dict[str, Path]:
    """What Prefect stored of each party's flow run of ``job`` (the run with its parameters,
    its task runs, logs and artifacts), written to ``folder/<party>/`` for the scan. The test
    processes share one Prefect server; each party's runs are what its own would hold."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters

    stored: dict[str, Path] = {}
    with get_client(sync_client=True) as client:
        named = filters.FlowRunFilter(name=filters.FlowRunFilterName(like_=f"{job}: "))
        for run in client.read_flow_runs(flow_run_filter=named):
            party = run.name.rsplit(": ", 1)[1]
            by_run = filters.FlowRunFilter(id=filters.FlowRunFilterId(any_=[run.id]))
            of_run = filters.LogFilter(flow_run_id=filters.LogFilterFlowRunId(any_=[run.id]))
            records = [
                run,
                *client.read_task_runs(flow_run_filter=by_run),
                *client.read_logs(log_filter=of_run),
                *client.read_artifacts(flow_run_filter=by_run),
            ]
            stored[party] = folder / party
            stored[party].mkdir(parents=True)
            text = "\n".join(record.model_dump_json() for record in records)
            (stored[party] / "records.json").write_text(text)
    return stored


def distinctive(ref: TableRef) -> set[str]:
    """The table's negative feature values (6 decimals in the demo data): a duration or a
    count Prefect records is never negative, so a match can only be a leak."""
    return {v for v in table_values(ref) if v.startswith("-")}


def assert_same_model(result: dict[str, Any], reference: dict[str, Any]) -> None:
    for key in MODEL:
        assert result[key] == reference[key], key  # bit for bit
    assert result["total_rows"] == reference["total_rows"]


def test_hospital_processes_fit_the_local_run_model_without_a_killed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parties = Parties(tmp_path / "orgs", "slda-parties")
    try:
        parties.run(COORDINATOR, {**OPTIONS, "stage_timeout": 10, "join_timeout": 120})
        for name in HOSPITALS:  # hospital_d dies after sharing its keys, before masking
            parties.run(name, OPTIONS, "0:mask_input:kill" if name == KILLED else None)
        assert parties.finish(KILLED)[0] == -9
        parties.servers.pop(KILLED).stop(grace=0).wait()  # its endpoint goes down too
        results = {party: parties.result(party) for party in parties.runs if party != KILLED}
    finally:
        parties.close()
    reference = local_run(tmp_path / "one", monkeypatch)

    coordinator = results.pop(COORDINATOR)
    survivors = [name for name in HOSPITALS if name != KILLED]
    assert_same_model(coordinator, reference)
    assert coordinator["contributors"] == survivors and coordinator["dropped"] == [KILLED]
    # the gaps were filled with the pooled statistics of the same round as in the local run
    assert coordinator["preprocessing"] == reference["preprocessing"]
    gaps = {c["name"]: c["missing"] for c in coordinator["preprocessing"]["columns"]}
    assert gaps["mean_radius"] > 0 and gaps["mean_texture"] > 0
    for name, result in results.items():  # every survivor kept the same model in its store
        assert_same_model(result, reference)
        stored = ArtifactStore(PartyStore.of(parties.refs[name])).get(result["model_key"])
        assert np.array_equal(stored["direction"], reference["direction"])
        assert result["release"]["budget"] is None  # exact release: nothing charged
    # the held-out figures: the survivors' counts, as in the local run
    assert coordinator["figures"] == reference["figures"]
    rows = sum(results[name]["holdout"]["rows"] for name in survivors)
    assert coordinator["figures"]["holdout_rows"] == rows > 0
    for org in parties.orgs.values():
        own_messages_only(org)
    # what Prefect stored of each party's run (parameters, task runs, logs, artifacts) holds
    # no feature value of another party's table (the coordinator's: of none)
    stored = prefect_records("slda-parties", tmp_path / "prefect")
    assert sorted(stored) == sorted([COORDINATOR, *HOSPITALS])
    # the model is every party's (its artifact shows six significant digits): a coefficient
    # of the standardised columns may print as a cell value does, which is not a leak
    model = [*coordinator["direction"], coordinator["intercept"]]
    public = {str(float(f"{w:.6g}")) for w in model}
    for party, folder in stored.items():
        for name, ref in parties.refs.items():
            if name != party:
                assert found_in(folder, distinctive(ref)) - public == set(), (party, name)
    control = stored["hospital_a"] / "control.txt"  # the scan finds a value written as a log
    value = sorted(distinctive(parties.refs["hospital_b"]))[0]
    control.write_text(f"weights [{value}, 2.5]")
    assert found_in(stored["hospital_a"], distinctive(parties.refs["hospital_b"])) == {value}


def test_a_site_refuses_a_call_for_fewer_noise_shares(tmp_path: Path) -> None:
    """A coordinator calling the sum with a lower threshold would unmask sums holding fewer
    noise shares than every site's calibration counts on: the site refuses, naming it."""
    agreed = steps.SparseLDAJob(
        "slda-call", tuple(HOSPITALS), "debiased", 1.0, 1e-6, None, None, 3,
        privacy_unit="row", row_clip_norm=3.0,
    )  # fmt: skip
    channel = channel_for("slda-call", str(tmp_path))
    options = SparseLDAOptions(epsilon=1.0, delta=1e-6, stage_timeout=5.0)
    lower = Coordinator(replace(agreed, threshold=2), options, channel.endpoint(COORDINATOR),
                        coordinator_store(str(tmp_path)))  # fmt: skip
    call_sum.fn(lower, 30, ThresholdRule())
    ref = TableRef(database=str(tmp_path / "hospital_a.duckdb"), table="patients")
    site = Site(ref, agreed, channel.endpoint(ref.party))
    with pytest.raises(ProtocolViolationError, match=r"hospital_a: .* threshold 2 \(agreed: 3\)"):
        await_sum_call.fn(site, ThresholdRule(), 30)
