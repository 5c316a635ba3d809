"""Sparse LDA with every hospital and the coordinator its own OS process, over mTLS gRPC.

Each process is given only its own ``party.toml`` and, for a hospital, its own database; the
model every process ends with must be, bit for bit, the one the one-process ``sparse_lda``
computes on the same data and options. The releases are exact (``noise_disabled_for_testing``,
allowed by each table's owner), so equality is exact; the secure sum, the fit and the
post-processing are the same code either way. The message endpoints are served from this test
process (as ``privreg party serve`` would), so a killed hospital's sent messages stay there.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from test_vertical_parties import found_in, own_messages_only, table_values

from demo.orgs import make_orgs, start
from flows.sparse_lda import sparse_lda
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_config import PartyConfig
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from storage.transport_grpc import serve
from tasks.secure_sum import COORDINATOR

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ["hospital_a", "hospital_b", "hospital_c"]
OPTIONS = {
    "epsilon": 1.0,
    "delta": 1e-6,
    "privacy_unit": "row",
    "row_clip_norm": 3.0,
    "method": "debiased",
    "threshold": 2,
    "noise_disabled_for_testing": True,  # exact releases: the models must agree bit for bit
}
MODEL = ("features", "direction", "mean_positive", "mean_negative", "support", "contributors")


def hospital_table(folder: Path, name: str) -> TableRef:
    """The demo hospital's rows in a database of its own, whose owner allows exact releases."""
    ref = TableRef(
        database=str(folder / f"{name}.duckdb"),
        table="patients",
        id_column="patient_id",
        label_column="diagnosis",
        label_domain=(0, 1),
    )
    frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")
    PartyStore.of(ref).write_table(ref.table, frame)
    OwnerPolicy(PartyStore.of(ref)).set(ref.table, allow_noiseless_release=True)
    return ref


def one_process(folder: Path, **options: Any) -> dict[str, Any]:
    folder.mkdir()
    refs = [hospital_table(folder, name).to_dict() for name in HOSPITALS]
    return sparse_lda(refs, workspace=str(folder), **OPTIONS, **options)


class Parties:
    """The organisations of one job: message endpoints served here, each party's flow in its
    own process, started with only its own configuration (and the coordinator, optionally,
    on a Prefect of its own)."""

    def __init__(self, folder: Path, job: str, own_prefect: str | None = None) -> None:
        from prefect.settings import PREFECT_API_URL

        self.orgs = make_orgs(folder, [COORDINATOR, *HOSPITALS], receive_timeout=120)
        self.refs = {name: hospital_table(self.orgs[name].folder, name) for name in HOSPITALS}
        self.servers = {n: serve(PartyConfig.load(o.config))[0] for n, o in self.orgs.items()}
        self.api = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}
        self.job, self.own_prefect = job, own_prefect
        self.runs: dict[str, subprocess.Popen] = {}

    def run(self, party: str, options: dict[str, Any], fault: str | None = None) -> None:
        args = ["--job", self.job, "--parties", ",".join(HOSPITALS)]
        args += ["--options", json.dumps(options)]
        if party in self.refs:
            args += ["--table", json.dumps(self.refs[party].to_dict())]
        args += ["--inject-fault", fault] if fault else []
        api = {} if party == self.own_prefect else self.api
        with open(self.orgs[party].folder / "stderr.log", "a") as log:
            self.runs[party] = start(self.orgs[party], "sparse-lda", args, api, stderr=log)

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


def assert_same_model(result: dict[str, Any], reference: dict[str, Any]) -> None:
    for key in MODEL:
        assert result[key] == reference[key], key  # bit for bit
    assert result["total_rows"] == reference["total_rows"]


def test_hospital_processes_fit_the_one_process_model(tmp_path: Path) -> None:
    options = {**OPTIONS, "holdout_fraction": 0.2}
    parties = Parties(tmp_path / "orgs", "slda-parties", own_prefect=COORDINATOR)
    try:
        parties.run(COORDINATOR, {**options, "stage_timeout": 60, "join_timeout": 120})
        for name in HOSPITALS:
            parties.run(name, options)
        results = {party: parties.result(party) for party in parties.runs}
    finally:
        parties.close()
    reference = one_process(tmp_path / "one", holdout_fraction=0.2)

    coordinator = results.pop(COORDINATOR)
    assert_same_model(coordinator, reference)
    assert coordinator["contributors"] == HOSPITALS and coordinator["dropped"] == []
    assert coordinator["figures"] == reference["figures"]  # from the hospitals' held-out counts
    for name, result in results.items():  # every hospital kept the same model in its store
        assert_same_model(result, reference)
        stored = ArtifactStore(PartyStore.of(parties.refs[name])).get(result["model_key"])
        assert np.array_equal(stored["direction"], reference["direction"])
        assert result["holdout"]["rows"] > 0 and result["release"]["budget"] is None
    for org in parties.orgs.values():
        own_messages_only(org)
    # the coordinator's own Prefect (runs, parameters, results, logs) holds no feature value
    # of any hospital's table
    home = parties.orgs[COORDINATOR].folder / "prefect"
    assert b"slda-parties: coordinator" in b"".join(
        f.read_bytes() for f in home.rglob("*") if f.is_file()
    )
    for ref in parties.refs.values():
        assert found_in(home, table_values(ref)) == set(), ref.party


def test_a_hospital_killed_for_good_leaves_the_survivors_model(tmp_path: Path) -> None:
    parties = Parties(tmp_path / "orgs", "slda-kill")
    try:
        parties.run(COORDINATOR, {**OPTIONS, "stage_timeout": 10, "join_timeout": 120})
        for name in HOSPITALS:  # hospital_c dies (SIGKILL) after sharing its keys, for good
            parties.run(name, OPTIONS, "0:mask_input:kill" if name == "hospital_c" else None)
        assert parties.finish("hospital_c")[0] == -9
        parties.servers.pop("hospital_c").stop(grace=0).wait()  # its endpoint goes down too
        results = {p: parties.result(p) for p in (COORDINATOR, "hospital_a", "hospital_b")}
    finally:
        parties.close()
    reference = one_process(tmp_path / "one", inject_dropouts={"mask_input": ["hospital_c"]})

    assert results[COORDINATOR]["dropped"] == ["hospital_c"]
    for result in results.values():
        assert_same_model(result, reference)
        assert result["contributors"] == ["hospital_a", "hospital_b"]


def test_below_the_threshold_the_coordinator_fails_naming_the_missing(tmp_path: Path) -> None:
    parties = Parties(tmp_path / "orgs", "slda-too-few")
    started = time.monotonic()
    try:
        parties.run(COORDINATOR, {**OPTIONS, "stage_timeout": 5, "join_timeout": 120})
        parties.run("hospital_a", OPTIONS)
        parties.run("hospital_b", OPTIONS, "0:advertise_keys:raise")
        parties.run("hospital_c", OPTIONS, "0:mask_input:kill")
        code, _, log = parties.finish(COORDINATOR)
    finally:
        parties.close()
    assert code != 0 and time.monotonic() - started < 120
    assert "round 0 of job slda-too-few, stage mask_input: only 1 of 3 parties answered" in log
    assert "missing: hospital_b (no answer within 5 s); hospital_c (no answer within 5 s)" in log
