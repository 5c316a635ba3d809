"""The ``horizontal_lr`` flow under a Prefect test server, on the bundled three-hospital demo."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pytest
from helpers import arrays_in, summary_quality
from prefect import Task
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, ArtifactFilterType
from sklearn.metrics import log_loss, roc_auc_score

from core import horizontal_lr as hlr
from core import secagg
from core.preprocessing import FittedPreprocessing
from core.secagg import multiround as mr
from core.test_switches import CRASH_VARIABLE, FAULTS_VARIABLE
from federation.channel import Channel
from federation.workspace import channel_for
from flows.horizontal_lr import SimulatedCrashError, horizontal_lr, predict_proba
from storage import codec
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.models import ModelStore
from storage.party_store import PartyStore
from tasks import horizontal_lr as steps
from tasks import horizontal_party
from tasks.reporting import short_id
from tasks.secure_sum import coordinator_store
from tasks.summaries import holdout_split

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
LR, L2 = 0.5, 1e-3
FAST: dict[str, Any] = {"learning_rate": LR, "l2": L2, "tol": 0.0}
Loader = Callable[..., list[TableRef]]
# keys once per job, then per round only masked inputs and unmask answers (no key exchange)
# what a hospital sends the coordinator: its columns' names, its job key, its masked input,
# its signed view of the round's survivors (the consistency round) and its unmasking answer
TO_COORDINATOR = {
    "schema",
    "secagg_job_keys",
    "secagg_masked",
    "secagg_view",
    "secagg_unmask_response",
}


def load_hospitals(
    workspace: Path, frames: dict[str, pd.DataFrame] | None = None
) -> list[TableRef]:
    """Each hospital's demo rows (or a replacement frame) in its own database."""
    refs = []
    for name in HOSPITALS:
        ref = TableRef(
            database=str(workspace / f"{name}.duckdb"),
            table="patients",
            id_column="patient_id",
            label_column="diagnosis",
            label_domain=(0, 1),
        )
        frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")
        if frames and name in frames:
            frame = frames[name]
        PartyStore.of(ref).write_table(ref.table, frame)
        refs.append(ref)
    return refs


@pytest.fixture
def hospitals() -> Iterator[Loader]:
    """Load the demo hospitals into a workspace, keeping every database open for the test.

    A long-lived party process holds its database open, and DuckDB then reopens the file in
    about a millisecond instead of ~30 ms, which is most of a small flow's time.
    """
    handles: list[duckdb.DuckDBPyConnection] = []

    def load(workspace: Path, frames: dict[str, pd.DataFrame] | None = None) -> list[TableRef]:
        refs = load_hospitals(workspace, frames)
        coordinator = coordinator_store(str(workspace)).path
        coordinator.parent.mkdir(exist_ok=True)
        handles.extend(duckdb.connect(p) for p in [*(r.database for r in refs), str(coordinator)])
        return refs

    yield load
    for handle in handles:
        handle.close()
    handles.clear()  # tracebacks kept by pytest.raises still reach the loader's list


def arrays(refs: list[TableRef], result: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each party's rows as it trains on them: scaled with the run's pooled statistics."""
    features = [c for c in PartyStore.of(refs[0]).read_table(refs[0]).columns[2:]]
    parts = [hlr.party_arrays(PartyStore.of(r).read_table(r), features, "diagnosis") for r in refs]
    if result["preprocessing"] is None:  # the job asked for no scaling
        return parts
    fitted = FittedPreprocessing.from_dict(result["preprocessing"])
    return [(fitted.transform(X), y) for X, y in parts]


def pooled(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.vstack([X for X, _ in parts]), np.concatenate([y for _, y in parts])


def run(
    refs: list[TableRef],
    workspace: Path,
    faults: dict[str, dict[str, str]] | None = None,
    crash_after: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Every side of the job in this process; ``faults`` and ``crash_after`` become the test
    switches of its job (``options["job_id"]``) in this process's environment for this run
    only (each side reads them: a hospital's step fails or hangs, the coordinator crashes)."""
    with pytest.MonkeyPatch.context() as switches:
        if faults:
            switches.setenv(FAULTS_VARIABLE, json.dumps({options["job_id"]: faults}))
        if crash_after:
            switches.setenv(CRASH_VARIABLE, f"{options['job_id']}:{crash_after}")
        return horizontal_lr([r.to_dict() for r in refs], workspace=str(workspace), **options)


def last_rounds(refs: list[TableRef], workspace: Path, job_id: str) -> dict[str, int]:
    stores = {r.party: PartyStore.of(r) for r in refs}
    stores["coordinator"] = coordinator_store(str(workspace))
    return {who: steps.checkpoints(s, job_id).last_round() for who, s in stores.items()}


def test_gradient_averaging_equals_centralized_gd_and_coordinator_sees_no_update(
    hospitals: Loader,
    workspace: Path,
) -> None:
    refs = hospitals(workspace)
    result = run(refs, workspace, rounds=2, **FAST)
    parts = arrays(refs, result)
    X, y = pooled(parts)

    reference = hlr.centralized_gd(X, y, L2, LR, 2)
    np.testing.assert_allclose(result["weights"], reference, rtol=0, atol=1e-6)
    assert result["rounds_run"] == 2 and result["resumed_from"] == 0
    assert [e["survivors"] for e in result["history"]] == [list(HOSPITALS)] * 2
    assert result["history"][0]["loss"] == pytest.approx(hlr.objective(reference * 0, X, y, L2))
    frame = pd.concat([PartyStore.of(r).read_table(r) for r in refs])
    np.testing.assert_allclose(
        predict_proba(result, frame), hlr.predict_proba(reference, X), atol=1e-6
    )
    job = result["job_id"]
    for store in [coordinator_store(str(workspace))] + [PartyStore.of(r) for r in refs]:
        saved = ArtifactStore(store).get(steps.model_key(job))
        assert np.array_equal(steps.model_weights(saved), result["weights"])
        assert saved["rounds"] == 2
        assert steps.checkpoints(store, job).last_round() == 1

    # audit: the coordinator received keys, masked vectors and shares, never an update
    channel = channel_for(job, str(workspace))
    received = [r for r in channel.log() if r.receiver == "coordinator"]
    assert {r.base_kind for r in received} == TO_COORDINATOR
    plain = {
        party: hlr.local_gradient(hlr.init_model(X.shape[1]), Xp, yp, L2).packed()
        for party, (Xp, yp) in zip(HOSPITALS, parts, strict=True)
    }  # round 0 starts from zero weights, so these are exactly what the parties masked
    for record in received:
        raw = channel.read_raw(record)
        for array in arrays_in(codec.loads(raw)):
            for update in plain.values():
                encoded = secagg.encode(update, len(HOSPITALS))
                assert encoded.tobytes() not in array.tobytes()
                assert update.tobytes() not in array.tobytes()
        if record.base_kind == "secagg_masked":
            masked = codec.loads(raw)["masked"].view(np.int64)
            assert np.mean(np.abs(masked) > 2.0**50) > 0.9  # uniform-looking, not small numbers

    # the UI shows the rounds table, a progress bar and a link to the saved model
    key = f"patients-horizontal-{short_id(job)}-"  # job named by its table, keyed by its id
    keys = [f"{key}rounds", f"{key}model"]
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys))
        )
        progress = client.read_artifacts(
            artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"]))
        )
    assert {a.key: a.type for a in found} == dict(zip(keys, ["table", "markdown"], strict=True))
    assert any(a.data == 100.0 and job in (a.description or "") for a in progress)

    # running it again resumes the same job (rounds are not part of the job id): nothing is
    # redone, and its rounds table marks both rounds as reused from the earlier attempt
    again = run(refs, workspace, rounds=2, **FAST)
    assert again["job_id"] == job and again["resumed_from"] == 2 and again["rounds_run"] == 0
    assert np.array_equal(again["weights"], result["weights"])
    rounds = json.loads(Artifact.get(f"{key}rounds").data)
    assert [r["reused"] for r in rounds] == ["yes", "yes"]
    # its hospitals were told to stop: more rounds of it are refused, naming the way on
    with pytest.raises(ValueError, match=r"ended after 2 rounds.*start a new job"):
        run(refs, workspace, rounds=3, **FAST)


def test_held_out_rows_stay_out_of_training_and_each_party_scores_its_own(
    hospitals: Loader, workspace: Path
) -> None:
    refs = hospitals(workspace)
    result = run(refs, workspace, rounds=2, holdout_fraction=0.2, **FAST)
    parts = arrays(refs, result)
    splits = [holdout_split(len(y), 0.2, result["job_id"]) for _, y in parts]
    training = [(X[train], y[train]) for (X, y), (train, _) in zip(parts, splits, strict=True)]
    reference = hlr.centralized_gd(*pooled(training), L2, LR, 2)  # the training rows only
    np.testing.assert_allclose(result["weights"], reference, rtol=0, atol=1e-6)

    key = f"patients-horizontal-{short_id(result['job_id'])}-summary"  # keyed by its job id
    quality = summary_quality(key)  # read back from Prefect
    sums = np.zeros(3)
    for name, (X, y), (train, held) in zip(HOSPITALS, parts, splits, strict=True):
        scores, truth = hlr.predict_proba(reference, X[held]), y[held]
        prior = np.full(held.size, y[train].mean())
        rows = f"{name}'s {held.size} held-out rows"
        auc, model, baseline = quality[f"AUC at {name}"], *quality[f"log-loss at {name}"][:2]
        assert auc == (pytest.approx(roc_auc_score(truth, scores), rel=1e-5), 0.5, rows)
        assert model == pytest.approx(log_loss(truth, scores), rel=1e-5)
        assert baseline == pytest.approx(log_loss(truth, prior), rel=1e-5)
        sums += [held.size, held.size * log_loss(truth, scores), held.size * log_loss(truth, prior)]
    pooled_model, pooled_baseline, rows = quality["log-loss, pooled"]
    assert rows == f"{int(sums[0])} held-out rows of all parties"
    assert pooled_model == pytest.approx(sums[1] / sums[0], rel=1e-5)
    assert pooled_baseline == pytest.approx(sums[2] / sums[0], rel=1e-5)
    # each hospital's copy of the model keeps the ids it trained on and held out, so
    # scoring's in_training column says which rows the model saw
    for ref, (train, held) in zip(refs, splits, strict=True):
        ids = PartyStore.of(ref).read_table(ref)[ref.id_column].tolist()
        roles = ModelStore(PartyStore.of(ref)).row_roles(steps.model_key(result["job_id"]), ids)
        assert [i for i, r in enumerate(roles) if r == "held out"] == held.tolist()
        assert [i for i, r in enumerate(roles) if r == "train"] == train.tolist()


def test_a_partys_copy_of_the_model_is_a_step_of_its_own_run() -> None:
    """Keeping the model is a task run in the hospital's flow run (the UI shows it); reading
    the ids it trained on is a plain call inside it."""
    assert isinstance(horizontal_party.keep_model, Task)
    assert not isinstance(horizontal_party._model_rows, Task)


def test_a_failing_and_a_hanging_party_leave_the_survivors_model(
    hospitals: Loader, workspace: Path
) -> None:
    refs = hospitals(workspace)
    # c's step raises in round 0; b's step hangs past the deadline in round 2 (the stand-in
    # for a killed process)
    faults = {"0:mask_input": {"hospital_c": "raise"}, "2:reveal_shares": {"hospital_b": "hang"}}
    options = {"rounds": 3, "threshold": 2, "stage_timeout": 4, "job_id": "hlr-faults"}
    result = run(refs, workspace, faults, **options, **FAST)
    parts = dict(zip(HOSPITALS, arrays(refs, result), strict=True))

    # round 0 sums a and b (c had its job keys agreed, then failed: a and b revealed their
    # round-0 seeds with c); round 1's call leaves c out, so c re-keys and asks to rejoin,
    # and is back in round 2, which sums all three (b sent its masked input and only missed
    # the unmasking: its self-mask came from a's and c's shares)
    weights = hlr.init_model(parts["hospital_a"][0].shape[1])
    survivors = [["hospital_a", "hospital_b"]] * 2 + [list(HOSPITALS)]
    for senders in survivors:
        X, y = pooled([parts[p] for p in senders])
        weights = hlr.apply_mean_gradient(weights, hlr.gradient(weights, X, y, L2), LR)
    np.testing.assert_allclose(result["weights"], weights, rtol=0, atol=1e-6)
    assert [e["survivors"] for e in result["history"]] == survivors
    kinds = {
        (r.round, r.sender, r.base_kind)
        for r in channel_for(result["job_id"], str(workspace)).log()
    }
    assert (0, "hospital_c", "secagg_job_keys") in kinds
    assert (0, "hospital_c", "secagg_masked") not in kinds
    assert (1, "hospital_c", "rejoin") in kinds and (2, "hospital_c", "secagg_masked") in kinds
    assert (2, "hospital_b", "secagg_unmask_response") not in kinds
    # keys are agreed once per job (and once more by the party that re-keyed), not per round
    assert sorted(p for r, p, k in kinds if k in {"secagg_job_keys", "rejoin"}) == [
        "hospital_a",
        "hospital_b",
        "hospital_c",
        "hospital_c",
    ]


def test_fewer_survivors_than_threshold_abort_the_round_uncommitted(
    hospitals: Loader, workspace: Path
) -> None:
    refs = hospitals(workspace)
    faults = {"0:mask_input": {"hospital_b": "raise", "hospital_c": "hang"}}
    with pytest.raises(secagg.InsufficientSurvivorsError, match="fewer than the threshold 2") as e:
        run(
            refs,
            workspace,
            rounds=3,
            job_id="hlr-too-few",
            stage_timeout=3,
            faults=faults,
            **FAST,
        )
    message = str(e.value)
    assert "round 0 of job hlr-too-few, stage mask_input" in message
    # the coordinator knows only that neither answered (each side is its own party)
    assert "hospital_b (no answer within 3 s)" in message
    assert "hospital_c (no answer within 3 s)" in message
    assert set(last_rounds(refs, workspace, "hlr-too-few").values()) == {-1}  # no checkpoint
    kinds = {(r.sender, r.base_kind) for r in channel_for("hlr-too-few", str(workspace)).log()}
    assert ("hospital_a", "secagg_masked") in kinds and ("hospital_b", "secagg_masked") not in kinds
    assert not {k for _, k in kinds} & {"secagg_unmask_request", "model"}


def _extra_column(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(smoker=0.0)


def _no_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.iloc[:0]


def _label_two(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(diagnosis=frame["diagnosis"].where(frame.index != 5, 2))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (_extra_column, hlr.SchemaMismatchError, "party 'hospital_c': feature columns differ"),
        (_no_rows, hlr.EmptyPartyError, "party 'hospital_c': table 'patients' has no rows"),
        (_label_two, hlr.InvalidLabelError, r"party 'hospital_c'.*label 2(\.0)? is not 0 or 1"),
    ],
)
def test_bad_tables_are_refused_before_any_round(
    hospitals: Loader,
    workspace: Path,
    change: Any,
    error: type[Exception],
    message: str,
) -> None:
    demo = pd.read_csv(ROOT / "demo" / "horizontal" / "hospital_c.csv")
    refs = hospitals(workspace, {"hospital_c": change(demo)})
    descriptors = [r.to_dict() for r in refs]
    descriptors[2]["label_domain"] = None  # let the store hold the bad label; the flow refuses it
    with pytest.raises(error, match=message):
        horizontal_lr(descriptors, rounds=2, workspace=str(workspace), job_id="hlr-bad")
    channel = Channel(workspace, "hlr-bad")
    assert not [r for r in channel.log() if r.base_kind.startswith("secagg")]
    assert set(last_rounds(refs, workspace, "hlr-bad").values()) == {-1}


def test_killed_run_resumes_and_ends_with_the_uninterrupted_model(
    hospitals: Loader, workspace: Path, tmp_path: Path
) -> None:
    refs = hospitals(workspace)
    options = {"rounds": 2, "local_epochs": 2, "job_id": "hlr-resume", **FAST}
    # killed mid-round, after the masked inputs were sent: round 0 left half done
    with pytest.raises(SimulatedCrashError):
        run(refs, workspace, crash_after="0:mask_input", **options)
    assert set(last_rounds(refs, workspace, "hlr-resume").values()) == {-1}
    # killed after the coordinator committed round 1 but before the parties saved it
    with pytest.raises(SimulatedCrashError):
        run(refs, workspace, crash_after="1:commit", **options)
    assert last_rounds(refs, workspace, "hlr-resume") == {
        "hospital_a": 0,
        "hospital_b": 0,
        "hospital_c": 0,
        "coordinator": 1,
    }
    # the coordinator's commit of round 1 stands: the parties check and save it from its
    # result (each unmasks round 1's sum itself from its peers' copies), nothing is redone
    resumed = run(refs, workspace, **options)
    assert resumed["resumed_from"] == 2 and resumed["rounds_run"] == 0
    assert [e["round"] for e in resumed["history"]] == [0, 1]
    assert set(last_rounds(refs, workspace, "hlr-resume").values()) == {1}

    other = tmp_path / "uninterrupted"
    other.mkdir()
    straight = run(hospitals(other), other, **options)
    assert straight["rounds_run"] == 2
    assert np.array_equal(resumed["weights"], straight["weights"])  # bit for bit
    fit = hlr.train_federated(arrays(refs, resumed), 2, LR, L2, epochs_per_round=2)  # in-process
    assert np.array_equal(resumed["weights"], fit.weights)


def test_a_rerun_round_is_never_unmasked_for_other_senders(
    hospitals: Loader, workspace: Path
) -> None:
    refs = hospitals(workspace)
    options = {"rounds": 1, "job_id": "hlr-guard", **FAST}
    with pytest.raises(SimulatedCrashError):
        run(refs, workspace, crash_after="0:reveal_shares", **options)
    # round 0 was unmasked for all three; redoing it without hospital_c would let the
    # coordinator subtract the two sums and read hospital_c's gradient. The coordinator's
    # stored requests stand (the parties answer one request per round), so the re-run can
    # only finish the round with the senders it had, hospital_c's stored input included
    rerun = run(refs, workspace, faults={"0:mask_input": {"hospital_c": "raise"}}, **options)
    assert rerun["history"][0]["survivors"] == list(HOSPITALS)
    X, y = pooled(arrays(refs, rerun))
    np.testing.assert_allclose(rerun["weights"], hlr.centralized_gd(X, y, L2, LR, 1), atol=1e-6)


def test_a_transient_fault_is_retried_without_masking_again(
    hospitals: Loader, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = hospitals(workspace)
    masked: list[str] = []
    real_mask, real_write = mr.mask_round, Channel._write_each

    def counting_mask(state: Any, values: np.ndarray) -> Any:
        masked.append(state.party)
        return real_mask(state, values)

    def flaky_write(self: Channel, round_: int, sender: str, kind: str, payloads: Any) -> Any:
        first_masked = kind == "secagg_masked" and "failed" not in masked
        if sender == "hospital_a" and first_masked:
            masked.append("failed")
            raise OSError("connection reset while sending")  # after the state was stored
        return real_write(self, round_, sender, kind, payloads)

    monkeypatch.setattr(mr, "mask_round", counting_mask)
    monkeypatch.setattr(Channel, "_write_each", flaky_write)
    # unscaled: the pooled statistics' own secure sum would mask (and be counted) first
    result = run(refs, workspace, rounds=1, preprocessing={"scaling": "none"}, **FAST)
    # the parties mask concurrently; a masked once although its first send failed
    assert sorted(masked) == ["failed", "hospital_a", "hospital_b", "hospital_c"]
    X, y = pooled(arrays(refs, result))
    np.testing.assert_allclose(result["weights"], hlr.centralized_gd(X, y, L2, LR, 1), atol=1e-6)


def _tamper_model(
    monkeypatch: pytest.MonkeyPatch,
    rounds: tuple[int, ...],
    freeze: bool,
    receivers: tuple[str, ...] = HOSPITALS,
) -> None:
    """A malicious coordinator: its model messages of ``rounds`` to ``receivers`` repeat the
    model it sent each of them the round before.

    ``freeze`` also replaces the mean update by zeros, so the repeated model is consistent
    with it; otherwise the real mean update is sent along.
    """
    monkeypatch.undo()  # one malicious coordinator at a time
    real_write = Channel._write_each
    given: dict[str, Any] = {}  # receiver ─▶ the weights it was last sent

    def write(self: Channel, r: int, sender: str, kind: str, payloads: dict[str, Any]) -> Any:
        if sender == "coordinator" and kind == "model":
            payloads = dict(payloads)
            for receiver, payload in payloads.items():
                if r in rounds and receiver in receivers:
                    payload = {**payload, "weights": given[receiver]}
                    if freeze:
                        payload["mean_update"] = np.zeros_like(payload["mean_update"])
                    payloads[receiver] = payload
                given[receiver] = payload["weights"]
        return real_write(self, r, sender, kind, payloads)

    monkeypatch.setattr(Channel, "_write_each", write)


def test_the_coordinator_cannot_unmask_one_party_across_rounds(
    hospitals: Loader, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15.2: the same weights twice, then everyone but C: the difference is C's update."""
    refs = hospitals(workspace)
    claim_c_dropped = {"2:mask_input": {"hospital_c": "raise"}}
    options = {"rounds": 3, "threshold": 2, "faults": claim_c_dropped, "stage_timeout": 4, **FAST}

    # the repeated model with the real mean update: every party refuses to save round 1
    _tamper_model(monkeypatch, rounds=(1,), freeze=False)
    with pytest.raises(secagg.ProtocolViolationError, match="coordinator's model of round 1 is"):
        run(refs, workspace, job_id="hlr-attack-repeat", **options)
    assert last_rounds(refs, workspace, "hlr-attack-repeat")["hospital_a"] == 0

    # with a made-up zero update to match: each party that helped unmask round 1 unmasked the
    # sum itself from its peers' copies, and the coordinator's update is not that sum's
    _tamper_model(monkeypatch, rounds=(1,), freeze=True)
    with pytest.raises(secagg.ProtocolViolationError, match="is not the one of the sum"):
        run(refs, workspace, job_id="hlr-attack-freeze", **options)
    assert last_rounds(refs, workspace, "hlr-attack-freeze")["hospital_a"] == 0

    # a party that missed the unmasking of round 1 cannot check the sum; fed the repeated model
    # (in round 1, and in round 2, which leaves it out while it rejoins), it refuses to
    # contribute at round 0's model again when it is back in round 3, before masking anything
    _tamper_model(monkeypatch, rounds=(1, 2), freeze=True, receivers=("hospital_b",))
    faults = {"1:reveal_shares": {"hospital_b": "raise"}, "3:mask_input": {"hospital_c": "raise"}}
    with pytest.raises(
        secagg.ProtocolViolationError, match="round 3 of job hlr-attack-b at the same model"
    ):
        run(refs, workspace, job_id="hlr-attack-b", **{**options, "faults": faults, "rounds": 4})
    log = channel_for("hlr-attack-b", str(workspace)).log()
    assert not [r for r in log if r.round == 3 and r.base_kind == "secagg_unmask_response"]
