"""The demo pipeline with every organisation its own OS process, against the local run.

A small version of the demo's job files (one vertical epoch, 1024-bit keys, three horizontal
rounds, two hospitals) runs twice: once through the local ``pipeline`` (every party's side in
one process, over the shared folder), and once with each party (clinic, lab, arbiter,
registry, two hospitals, the coordinator) its own ``privreg party pipeline`` process in its own
folder, holding its own database, certificate, Prefect home, a copy of the job files and only
its own source files, over mTLS on loopback. Both run the same side flows with the same job ids.

What must be equal: PSI's intersections, every vertical model slice (bit for bit), the WALR
model and the horizontal model. The mechanisms' noise comes from the OS CSPRNG; WALR runs with
its test-only noise switch (its owner's policy allows it), so it is exact too. Label DP has no
such switch: the released labels differ between the runs, so what is compared is what the
noise does not decide (rows, budget charged, grid, training rows).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import vertical_slices
from prefect.artifacts import Artifact

from core.dp.accounting import ApproximateDP, Charge, composed_epsilon
from core.job_files import read_job
from core.test_switches import NOISELESS_VARIABLE
from demo.orgs import Org
from demo.parties import SMALL_KEYS, prepare, run_job
from federation.party_config import ENV_VAR
from flows.pipeline import pipeline
from flows.pipeline_party import PipelineRefusalError, pipeline_party
from flows.vertical_lr import vertical_lr
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.models import ModelStore
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from tasks import horizontal_lr, label_dp, secure_sum, sparse_lda, walr
from tasks.reporting import PUBLISHED

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ("hospital_a", "hospital_b")
EXACT_JOBS = ("demo-walr", "sparse_lda_demo-sparse_lda")  # the party processes' job ids


def small_jobs(folder: Path) -> dict[str, dict[str, Any]]:
    """The demo's job files, shrunk, under ``folder/jobs`` (paths as in the bundled files)."""
    jobs = {path.name: read_job(path) for path in (ROOT / "jobs").glob("*.json")}
    main = jobs["demo.json"]
    main["vertical"].update(epochs=1, key_size=1024)
    main["walr"].update(key_size=1024, noise=False)
    # WALR's hold-out takes rows by position in PSI's order, which is each run's own (as for
    # vertical LR); without it both runs release the sum over the same rows
    main["walr"]["holdout_fraction"] = 0.0
    for name in ("horizontal_demo.json", "sparse_lda_demo.json"):
        jobs[name]["parties"] = {h: jobs[name]["parties"][h] for h in HOSPITALS}
    # horizontal LR seeds each hospital's hold-out with the job id, which differs between the
    # two runs (tests/test_horizontal_parties.py compares party and one-process hold-outs)
    # seven processes start at once on one SQLite-backed test server, whose lock can stall a
    # hospital's first task for a minute: the coordinator's stages wait longer than in the demo
    jobs["horizontal_demo.json"]["horizontal_lr"].update(
        rounds=3, holdout_fraction=0.0, stage_timeout=300
    )
    # not the default scaling: each party's side must be given the job's preprocessing
    jobs["demo.json"]["preprocessing"] = {"scaling": "robust"}
    jobs["horizontal_demo.json"]["preprocessing"] = {"scaling": "none"}
    (folder / "jobs").mkdir(parents=True)
    for name, job in jobs.items():
        (folder / "jobs" / name).write_text(json.dumps(job))
    (folder / "demo").symlink_to(ROOT / "demo")
    return jobs


def one_process_copy(jobs: dict[str, dict[str, Any]], source: Path, folder: Path) -> Path:
    """The same jobs with absolute paths into ``folder`` for the one-process ``pipeline``."""
    for name, job in jobs.items():
        for entry in job["parties"].values():
            entry["source"] = str(source / entry["source"])
            entry["table"]["database"] = str(folder / Path(entry["table"]["database"]).name)
        for kind, path in job.get("subjobs", {}).items():
            job["subjobs"][kind] = str(folder / Path(path).name)
        (folder / name).write_text(json.dumps(job))
    return folder / "demo.json"


def allow_noiseless(source: Path, where: Callable[[str, str], Path]) -> None:
    """The owners of the clinic's and the hospitals' tables allow a release without noise (the
    test switches of WALR and sparse LDA); a policy needs the table, so each is loaded first
    (the pipeline's load replaces it). ``where(party, database)`` is the owner's database."""
    entries = [read_job(ROOT / "jobs/demo.json")["parties"]["guest"]]
    entries += [read_job(ROOT / "jobs/sparse_lda_demo.json")["parties"][h] for h in HOSPITALS]
    for entry in entries:
        table = entry["table"]
        ref = TableRef.from_dict(
            {**table, "database": str(where(table["party"], table["database"]))}
        )
        PartyStore.of(ref).import_file(source / entry["source"], ref)
        OwnerPolicy(PartyStore.of(ref)).set(ref.table, allow_noiseless_release=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The party processes' run, then the one-process reference: ``pipeline`` on the same job
    files, and ``vertical_lr`` on copies of the parties' aligned tables (PSI's row order comes
    from each run's secret keys, and the hold-out split and batches follow the row order)."""
    from prefect.settings import PREFECT_API_URL

    source = tmp_path_factory.mktemp("repository")
    jobs = small_jobs(source)
    # a side that agreed a job may wait minutes for the SQLite-backed test server before its
    # flow starts (CI saw 2 min between agreement and the coordinator's horizontal run):
    # its peers' waits for its first message allow for that
    orgs = prepare(tmp_path_factory.mktemp("orgs"), source=source, receive_timeout=300)
    allow_noiseless(source, lambda party, database: orgs[party].folder / database)
    # seven processes write to one SQLite-backed test server: let a busy one be retried longer
    extra = {
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PREFECT_CLIENT_MAX_RETRIES": "8",
        **SMALL_KEYS,  # each party's own opt-in to the shrunk job's 1024-bit keys
        NOISELESS_VARIABLE: ",".join(EXACT_JOBS),  # exact releases of these jobs (test switch)
    }
    parties = run_job(orgs, extra=extra, timeout=600)

    single = tmp_path_factory.mktemp("one-process")
    vertical = jobs["demo.json"].pop("vertical")
    jobs["demo.json"]["subjobs"].pop("score_vertical")
    job_file = one_process_copy(json.loads(json.dumps(jobs)), source, single)
    allow_noiseless(source, lambda _, database: single / Path(database).name)
    with pytest.MonkeyPatch.context() as switches:  # the same job ids as the party processes'
        switches.setenv(NOISELESS_VARIABLE, ",".join(EXACT_JOBS))
        one = _plain(pipeline(str(job_file), workspace=str(single)))
    aligned = []
    for party in ("clinic", "lab"):
        copy = single / "copies" / f"{party}.duckdb"
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(orgs[party].folder / "var/parties" / f"{party}.duckdb", copy)
        aligned.append({**_stage(parties[party], "demo", "psi")["aligned"], "database": str(copy)})
    preprocessing = jobs["demo.json"]["preprocessing"]
    reference = vertical_lr(
        aligned[0], aligned[1:], workspace=str(single), preprocessing=preprocessing, **vertical
    )
    return {"one": one, "vertical": reference, "aligned": aligned, "single": single,
            "orgs": orgs, "parties": parties}  # fmt: skip


def _plain(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The local run's results as the party processes print theirs (JSON-like dicts)."""
    return {party: dataclasses.asdict(result) for party, result in results.items()}


def _stage(result: dict[str, Any], job: str, stage: str) -> dict[str, Any]:
    return next(s for s in result["stages"] if (s["job"], s["stage"]) == (job, stage))["result"]


def _ids(descriptor: dict[str, Any]) -> set[str]:
    ref = TableRef.from_dict(descriptor)
    return set(PartyStore.of(ref).read_table(ref)[ref.id_column].astype(str))


def _table(store: PartyStore, name: str) -> Any:
    """A table's ids and probabilities (a scores table holds text columns too)."""
    with store.connect() as con:
        return con.execute(f'SELECT patient_id, probability FROM "{name}"').df()


def _stored(database: Path, key: str) -> dict[str, Any]:
    return ArtifactStore(PartyStore(database)).get(key)


def test_party_processes_end_with_the_local_run_models(runs: dict[str, Any]) -> None:
    one, single, parties = runs["one"], runs["single"], runs["parties"]
    orgs: dict[str, Org] = runs["orgs"]
    assert set(parties) == {"clinic", "lab", "arbiter", "registry", *HOSPITALS, "coordinator"}
    # every party ran exactly the stages that name it, with the agreed job ids, in both runs
    ran = {
        p: [(s["job"], s["stage"], s["job_id"]) for s in r["stages"]] for p, r in parties.items()
    }
    assert [s[1] for s in ran["arbiter"]] == ["vertical"]
    scoring = [("score_demo", s, f"score_demo-{s}") for s in ("load", "score_vertical")]
    assert (
        ran["lab"]
        == [("demo", s, f"demo-{s}") for s in ("load", "psi", "vertical", "walr")] + scoring
    )
    assert [s[1] for s in ran["clinic"]] == ["load", "psi", "vertical", "walr", "load", "psi",
                                             "label_dp", "load", "score_vertical"]  # fmt: skip
    assert [s[1] for s in ran["coordinator"]] == ["horizontal_lr", "sparse_lda"]
    assert ran["registry"][-1] == ("label_dp_demo", "label_dp", "label_dp_demo-label_dp")
    local = {p: [(s["job"], s["stage"], s["job_id"]) for s in r["stages"]] for p, r in one.items()}
    assert local["lab"] == [("demo", s, f"demo-{s}") for s in ("load", "psi", "walr")]  # no
    # vertical LR in the local copy (it is compared on the processes' own rows below): nothing
    # to score there
    assert local["coordinator"] == ran["coordinator"] and local["registry"] == ran["registry"]

    (key,) = {f["key"] for f in PUBLISHED.values() if f["key"].startswith("demo-pipeline-")}
    assert "KiB" in Artifact.get(key).data  # the run's one summary: the bytes each party sent

    # PSI: the same intersection (the row order is each run's own)
    for party in ("clinic", "lab"):
        psi, local_psi = (_stage(r[party], "demo", "psi") for r in (parties, one))
        assert psi["intersection_size"] == local_psi["intersection_size"] == 470
        assert Path(psi["aligned"]["database"]).is_relative_to(orgs[party].folder)
        assert _ids(psi["aligned"]) == _ids(local_psi["aligned"])

    # vertical LR: every party's slice equals the one-process flow's on the same aligned rows
    reference = runs["vertical"]
    aligned = [_stage(parties[p], "demo", "psi")["aligned"] for p in ("clinic", "lab")]
    assert vertical_slices("demo-vertical", *aligned) == vertical_slices(
        reference["job_id"], *runs["aligned"]
    )
    guest = _stage(parties["clinic"], "demo", "vertical")
    assert guest["metrics"] == reference["metrics"]

    # WALR (noise switched off): the release, exact integers, equals the local run's; the
    # fit sums floats over the rows in PSI's order, which is each run's own, so it agrees to
    # the optimiser's tolerance
    model = _stored(single / "lab.duckdb", walr.model_key("demo-walr"))
    lab = orgs["lab"].folder / "var/parties/lab.duckdb"
    party_model = _stored(lab, walr.model_key("demo-walr"))
    assert np.array_equal(party_model["noisy_sum"], model["noisy_sum"])
    assert np.allclose(
        list(party_model["coefficients"].values()), list(model["coefficients"].values()), atol=1e-6
    )
    assert party_model["intercept"] == pytest.approx(model["intercept"], abs=1e-6)
    labels = _stage(parties["clinic"], "demo", "walr")
    # without noise only the release's (1, 1e-5) is known, composed at the owner's 1e-4
    charged = composed_epsilon([Charge(ApproximateDP(1.0, 1e-5), 1.0, 1e-5)], 1e-4)
    assert labels["budget"]["epsilon_spent"] == pytest.approx(charged)
    assert not labels["reused_release"]

    # label DP: what the noise does not decide
    released = _stage(parties["registry"], "label_dp_demo", "label_dp")
    trained = _stage(parties["clinic"], "label_dp_demo", "label_dp")
    assert _stage(parties["registry"], "label_dp_demo", "psi")["intersection_size"] == 442
    assert released["rows"] == trained["rows"] == 442
    assert released["budget"]["epsilon_spent"] == 2.0
    assert released["mechanism"]["grid_size"] == 41 and released["mechanism"]["epsilon"] == 2.0
    single_model = _stored(
        single / "clinic_baseline.duckdb", label_dp.model_key("label_dp_demo-label_dp")
    )
    baseline = orgs["clinic"].folder / "var/parties/clinic_baseline.duckdb"
    party_model = _stored(baseline, label_dp.model_key("label_dp_demo-label_dp"))
    public = ("features", "rows", "link", "loss")
    assert {k: party_model[k] for k in public} == {k: single_model[k] for k in public}
    drawn = "distinct_noisy_values"  # shows the noise
    assert {k: v for k, v in party_model["mechanism"].items() if k != drawn} == {
        k: v for k, v in single_model["mechanism"].items() if k != drawn
    }

    # horizontal LR: the coordinator's and every hospital's model equal the local run's
    store = ArtifactStore(secure_sum.coordinator_store(str(single)))
    expected = store.get(horizontal_lr.model_key("horizontal_demo-horizontal_lr"))
    for party in (*HOSPITALS, "coordinator"):
        result = _stage(parties[party], "horizontal_demo", "horizontal_lr")
        assert result["weights"] == horizontal_lr.model_weights(expected).tolist(), party
        assert result["rounds_completed"] == expected["rounds"] == 3

    # each party promoted its share of the vertical model for the job, and the scoring sub-job
    # scored the new rows with them across the processes: the guest's scores of rows it also
    # trained on equal training's own predictions of them
    clinic_store = PartyStore(orgs["clinic"].folder / "var/parties/clinic.duckdb")
    for party in ("clinic", "lab"):
        own = PartyStore(orgs[party].folder / f"var/parties/{party}.duckdb")
        key, _ = ModelStore(own).promoted("demo", "vertical")
        assert key == f"models/vertical/demo-vertical/{party}"
    scored = _stage(parties["clinic"], "score_demo", "score_vertical")
    assert scored["rows"] == 470 and scored["scores_table"] == "patients_to_score_scored"
    shared = _stage(parties["lab"], "score_demo", "score_vertical")
    assert shared["rows"] == 470 and shared["model_job_id"] == "demo-vertical"
    trained = _table(clinic_store, guest["scores_table"])
    new = _table(clinic_store, "patients_to_score_scored")
    both = trained.merge(new, on="patient_id", suffixes=("_trained", "_scored"))
    assert len(both) == 470
    np.testing.assert_allclose(both["probability_scored"], both["probability_trained"], rtol=1e-9)

    # sparse LDA (noise switched off): the coordinator's and every hospital's model
    expected = store.get(sparse_lda.model_key("sparse_lda_demo-sparse_lda"))
    for party in (*HOSPITALS, "coordinator"):
        result = _stage(parties[party], "sparse_lda_demo", "sparse_lda")
        assert result["direction"] == np.asarray(expected["direction"]).tolist(), party
        assert result["support"] == list(expected["support"]), party


def test_a_party_refuses_a_table_outside_its_own_folder(
    runs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job file naming a database in the lab's folder for the clinic is refused before any
    table is loaded or message sent; only the clinic's state of the run (failed, and why) is
    written, for its peers to read."""
    clinic: Org = runs["orgs"]["clinic"]
    job = read_job(clinic.folder / "jobs/demo.json")
    job["parties"]["guest"]["table"]["database"] = "../lab/var/parties/lab.duckdb"
    job.pop("subjobs")
    (clinic.folder / "jobs/greedy.json").write_text(json.dumps(job))
    monkeypatch.setenv(ENV_VAR, str(clinic.config))
    before = set((clinic.folder / "home").rglob("*"))
    with pytest.raises(PipelineRefusalError, match="clinic refuses job demo: guest's database"):
        pipeline_party("jobs/greedy.json", run="greedy")
    status = clinic.folder / "home" / "runs" / "demo-greedy" / "status"
    written = set((clinic.folder / "home").rglob("*")) - before
    assert written and all(p in status.parents or p.is_relative_to(status) for p in written)
    state = json.loads((status / "clinic").read_text())
    assert state["state"] == "failed" and "guest's database" in state["reason"]
