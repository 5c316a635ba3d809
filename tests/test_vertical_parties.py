"""Vertical LR with each party its own OS process, own folder and database, over mTLS gRPC.

The guest (clinic), the hosts (two labs, each holding half of the host columns) and the
arbiter each run ``privreg party vertical`` with only their own ``party.toml``; the model they
end with must be, bit for bit, the one the one-process ``vertical_lr`` computes on the same
data and options, also when one host's process is killed mid-round and restarted. The
two-party mode (no arbiter) runs the guest and one host.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from helpers import chart_images, found_in
from prefect.settings import PREFECT_API_URL
from prefect_api import run_artifacts

from demo.orgs import Org, make_orgs, start
from demo.parties import SMALL_KEYS
from federation.party_config import PartyConfig
from federation.transport_grpc import serve
from flows.vertical_lr import vertical_lr
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore

pytestmark = pytest.mark.usefixtures("prefect_server")
DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "fate"
ROWS, ROUNDS = 200, 4  # 180 training rows: 2 batches of 90 per epoch, 2 epochs
OPTIONS = {
    "epochs": 2,
    "batch_size": 90,
    "learning_rate": 0.15,
    "momentum": 0.9,
    "l2": 0.01,
    "seed": 3,
    "key_size": 1024,
    "tol": 0.0,
}


ONE_HOST, TWO_HOSTS = ["lab"], ["lab1", "lab2"]


def tables(folder: Path, hosts: list[str]) -> dict[str, TableRef]:
    """The first breast rows, split as FATE splits them, in each party's own database; with
    two hosts, each holds half of the host's columns."""
    guest_frame = pd.read_csv(DATA / "breast_hetero_guest.csv.gz").head(ROWS)
    host_frame = pd.read_csv(DATA / "breast_hetero_host.csv.gz").set_index("id")
    host_frame = host_frame.loc[guest_frame["id"]]
    guest = TableRef(
        str(folder / "clinic" / "clinic.duckdb"), "patients", label_column="y", label_domain=(0, 1)
    )
    PartyStore.of(guest).import_frame(guest_frame, guest)
    refs = {"clinic": guest}
    for host, columns in zip(hosts, np.array_split(host_frame.columns, len(hosts)), strict=True):
        refs[host] = TableRef(str(folder / host / f"{host}.duckdb"), "labs")
        PartyStore.of(refs[host]).import_frame(host_frame[columns].reset_index(), refs[host])
    return refs


def one_process_run(folder: Path, hosts: list[str]) -> dict[str, Any]:
    """The one-process run: the guest's result and each host's slice from its store."""
    refs = tables(folder, hosts)
    result = vertical_lr(
        refs["clinic"].to_dict(), [refs[h].to_dict() for h in hosts], workspace=str(folder),
        **OPTIONS,
    )  # fmt: skip
    slices = {
        h: ArtifactStore(PartyStore.of(refs[h])).get(f"models/vertical/{result['job_id']}/{h}")
        for h in hosts
    }
    return {
        **result,
        "host_weights": {h: list(s["coefficients"].values()) for h, s in slices.items()},
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return one_process_run(tmp_path_factory.mktemp("one-process"), ONE_HOST)


@pytest.fixture(scope="module")
def one_process_two_hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return one_process_run(tmp_path_factory.mktemp("one-process-two-hosts"), TWO_HOSTS)


class Parties:
    """The organisations of one job: message endpoints served here, each party's steps in its
    own process (started with only its own configuration)."""

    def __init__(
        self,
        folder: Path,
        hosts: list[str],
        job: str,
        arbiter: bool = True,
        own_prefect: bool = False,
    ) -> None:
        from prefect.settings import PREFECT_API_URL

        names = ["clinic", *hosts, *(["arbiter"] if arbiter else [])]
        self.orgs = make_orgs(folder, names, receive_timeout=300)
        self.hosts, self.refs = hosts, tables(folder, hosts)
        self.servers = {
            name: serve(PartyConfig.load(org.config))[0] for name, org in self.orgs.items()
        }
        # the test's shared server, or each organisation's own Prefect (under its folder)
        api = {} if own_prefect else {"PREFECT_API_URL": str(PREFECT_API_URL.value())}
        self.api = {**api, **SMALL_KEYS}  # each party's own opt-in to the 1024-bit test keys
        self.job, self.arbiter = job, arbiter
        self.runs: dict[str, subprocess.Popen] = {}

    def run(self, party: str) -> None:
        role = "guest" if party == "clinic" else "host" if party in self.hosts else "arbiter"
        args = ["--job", self.job, "--role", role, "--guest", "clinic"]
        args += ["--hosts", ",".join(self.hosts)]
        args += ["--options", json.dumps(OPTIONS)]
        args += ["--table", json.dumps(self.refs[party].to_dict())] if party in self.refs else []
        args += [] if self.arbiter else ["--no-arbiter"]
        with open(self.orgs[party].folder / "stderr.log", "a") as log:
            self.runs[party] = start(self.orgs[party], "vertical", args, self.api, stderr=log)

    def results(self, timeout: float = 600) -> dict[str, dict[str, Any]]:
        deadline, results = time.monotonic() + timeout, {}
        for party, run in self.runs.items():
            out, _ = run.communicate(timeout=max(deadline - time.monotonic(), 1))
            log = (self.orgs[party].folder / "stderr.log").read_text()[-3000:]
            assert run.returncode == 0, f"{party} failed:\n{log}"
            results[party] = json.loads(out.strip().splitlines()[-1])
        return results

    def close(self) -> None:
        for run in self.runs.values():
            if run.poll() is None:
                run.kill()
                run.wait(timeout=10)
        for server in self.servers.values():
            server.stop(grace=0).wait()


def assert_same_model(
    results: dict[str, dict[str, Any]], reference: dict[str, Any], parties: Parties
) -> None:
    guest = results["clinic"]
    assert guest["intercept"] == reference["intercept"]  # bit for bit
    assert guest["coefficients"] == reference["coefficients"]
    assert guest["losses"] == reference["losses"]
    for host in parties.hosts:  # each slice read from its host's own store
        model = ArtifactStore(PartyStore.of(parties.refs[host])).get(results[host]["model_key"])
        assert list(model["coefficients"].values()) == reference["host_weights"][host]
        assert "coefficients" not in results[host]  # a host's slice stays in its own store


def own_messages_only(org: Org) -> None:
    files = [f for f in org.messages.rglob("r*/*") if f.is_file() and not f.name.startswith(".")]
    assert files and all(org.party in f.name.split("__")[:2] for f in files)


def test_a_killed_host_of_two_restarts_and_the_job_ends_with_the_same_model(
    tmp_path: Path, one_process_two_hosts
) -> None:
    parties = Parties(tmp_path, TWO_HOSTS, "vertical-kill")
    lab = parties.orgs["lab1"]
    mid_round = (
        lab.messages / "vertical-kill" / "messages" / "r000002" / "lab1__clinic__share_train"
    )
    try:
        for party in ("arbiter", *TWO_HOSTS, "clinic"):
            parties.run(party)
        deadline = time.monotonic() + 600
        while not mid_round.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        parties.runs["lab1"].send_signal(signal.SIGKILL)  # one host dies mid-round 2 ...
        assert parties.runs["lab1"].wait(timeout=10) == -signal.SIGKILL
        parties.servers["lab1"].stop(grace=0).wait()  # ... and its endpoint is down a while
        time.sleep(2)
        parties.servers["lab1"] = serve(PartyConfig.load(lab.config))[0]
        parties.run("lab1")
        results = parties.results()
    finally:
        parties.close()
    # four processes, one of them killed and restarted: the one-process model with the same
    # two hosts, bit for bit
    assert_same_model(results, one_process_two_hosts, parties)
    assert results["clinic"]["metrics"] == one_process_two_hosts["metrics"]
    for org in parties.orgs.values():
        own_messages_only(org)
    restarted = results["lab1"]
    assert restarted["resumed_from"] in (1, 2)  # its own last checkpoint
    assert restarted["resumed_from"] + 1 + restarted["rounds_run"] == ROUNDS
    # the peers waited for it: each ran every round exactly once
    assert {results[p]["rounds_run"] for p in ("clinic", "lab2", "arbiter")} == {ROUNDS}
    assert {results[p]["resumed_from"] for p in ("clinic", "lab2", "arbiter")} == {-1}
    # so the guest's rounds table names its one run's first try for every round, none reused
    # (rounds of an earlier attempt are marked reused: test_operations), and its charts draw
    # the loss per round and the ROC of its held-out rows
    env = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}
    run, published = run_artifacts(env, "vertical_lr vertical-kill: guest")
    rounds = json.loads(published["rounds"]["data"])
    assert [(r["round"], r["attempt"], r["reused"]) for r in rounds] == [
        (r, f"{run['id'][:8]} try 1", "") for r in range(ROUNDS)
    ]
    charts = published["charts"]["data"]
    assert "training and held-out loss per round" in charts and "ROC, " in charts
    assert [c[:4] for c in chart_images(charts)] == ["<svg", "<svg"]


def table_values(ref: TableRef) -> set[str]:
    """Every feature value of a party's table, as a number is written in text (ids and 0/1
    labels are small integers that any log holds, so they are not scanned for)."""
    frame = PartyStore.of(ref).read_table(ref, allow_missing=True)  # a missing cell: skipped
    features = frame.drop(columns=[c for c in (ref.id_column, ref.label_column) if c])
    return {repr(float(v)) for v in features.to_numpy().ravel() if abs(float(v)) >= 1e-3}


def test_two_party_mode_processes_train_the_same_model(tmp_path: Path, one_process) -> None:
    # each organisation on its own Prefect, so what each one's Prefect stored can be scanned
    parties = Parties(tmp_path, ONE_HOST, "vertical-2p", arbiter=False, own_prefect=True)
    try:
        for party in ("lab", "clinic"):
            parties.run(party)
        results = parties.results()
    finally:
        parties.close()
    assert_same_model(results, one_process, parties)
    # neither organisation's Prefect (runs, parameters, results, logs, artifacts) holds a
    # feature value of the other's table; the guest's holds no host row, and vice versa
    homes = {party: org.folder / "prefect" for party, org in parties.orgs.items()}
    assert all((home / "prefect.db").exists() for home in homes.values())
    for party, other in (("clinic", "lab"), ("lab", "clinic")):
        stored = b"".join(f.read_bytes() for f in homes[party].rglob("*") if f.is_file())
        assert f"vertical-2p: {results[party]['role']}".encode() in stored  # its runs are there
        assert found_in(homes[party], table_values(parties.refs[other])) == set(), party
    control = tmp_path / "control"  # the scan finds a value written the way a log would
    control.mkdir()
    value = sorted(table_values(parties.refs["lab"]))[0]
    (control / "log.txt").write_text(f"weights [{value}, 2.5]")
    assert found_in(control, table_values(parties.refs["lab"])) == {value}
