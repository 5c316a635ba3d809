"""The ``sparse_lda`` flow under a Prefect test server, on the three-hospital demo data."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pytest
from helpers import FetchLog, arrays_in
from prefect.exceptions import ParameterTypeError
from prefect.logging import disable_run_logger

from core import secagg
from core.dp import analytic_gaussian_sigma, zcdp_sigma
from core.preprocessing import FittedPreprocessing, PreprocessingSpec
from core.sparse_lda import (
    ColumnMismatchError,
    DegenerateDataError,
    DimensionLimitError,
    LocalFitSettings,
    MissingClassError,
    PartyData,
    PrivacySettings,
    calibrate,
    fit_centralized,
    fit_local,
    fit_moments_release,
    sum_sensitivity,
)
from core.sparse_lda.privacy import add_noise_share, clip_to_norm, round_to_grid
from core.test_switches import FAULTS_VARIABLE, NOISELESS_VARIABLE
from federation.channel import Channel
from federation.workspace import channel_for
from flows.sparse_lda import sparse_lda, summary_line
from storage import codec
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import BudgetError, PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from storage.validation import MissingValuesError
from tasks import secure_sum
from tasks import sparse_lda as steps
from tasks import sparse_lda_party as party_steps
from tasks.reporting import PUBLISHED
from tasks.scoring import local_scores

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
ROWS = {"hospital_a": 240, "hospital_b": 190, "hospital_c": 139}
EPS, DELTA, CLIP = 1.0, 1e-6, 4.0
# an exact fit has no noise to cut, and a cut this small (the schema refuses 0) keeps all of it
NO_THRESHOLD = {"hard_threshold_scale": 1e-12}
TO_COORDINATOR = {
    "schema",
    "secagg_keys",
    "secagg_shares",
    "secagg_masked",
    "secagg_unmask_response",
}
Loader = Callable[..., list[TableRef]]


@pytest.fixture
def hospitals() -> Iterator[Loader]:
    """Each hospital's demo rows (or a replacement frame) in its own database, with a budget.

    Every database stays open for the test: DuckDB then reopens a file in ~1 ms, not ~30 ms.
    """
    handles: list[duckdb.DuckDBPyConnection] = []

    def load(
        workspace: Path,
        frames: dict[str, pd.DataFrame] | None = None,
        spec: PreprocessingSpec | None = None,
    ) -> list[TableRef]:
        """``spec``: imported as a job file's load does (its missing values read as missing);
        without one, stored as given."""
        refs = []
        for name in HOSPITALS:
            ref = TableRef(
                database=str(workspace / f"{name}.duckdb"),
                table="patients",
                id_column="patient_id",
                label_column="diagnosis",
            )
            frame = (frames or {}).get(name)
            if frame is None:
                frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")
            if spec is None:
                PartyStore.of(ref).write_table(ref.table, frame)
            else:
                PartyStore.of(ref).import_frame(frame, ref, spec)
            PrivacyLedger(PartyStore.of(ref)).set_budget(ref.table, 3 * EPS, 3 * DELTA)
            # the owners allow the test-only options (exact releases, the pooled reference)
            OwnerPolicy(PartyStore.of(ref)).set(
                ref.table, allow_noiseless_release=True, allow_raw_export=True
            )
            refs.append(ref)
        coordinator = secure_sum.coordinator_store(str(workspace)).path
        coordinator.parent.mkdir(exist_ok=True)
        handles.extend(duckdb.connect(p) for p in [*(r.database for r in refs), str(coordinator)])
        return refs

    yield load
    for handle in handles:
        handle.close()
    handles.clear()


@pytest.fixture
def fits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the parties whose local fit ran (the expensive step a reuse must skip)."""
    ran: list[str] = []
    real = steps.fit_local

    def counting(party: Any, settings: Any, *, debiased: bool) -> Any:
        ran.append(party.name)
        return real(party, settings, debiased=debiased)

    monkeypatch.setattr(steps, "fit_local", counting)
    return ran


_EXACT_JOBS = itertools.count()


def run(
    refs: list[TableRef],
    workspace: Path,
    exact: bool = False,
    silent: dict[str, list[str]] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The local run of the side flows on the stored values (``scaling: none``, so the plain
    fits are comparable); the scaling test passes the default. ``exact`` (no noise) and
    ``silent`` (sites whose step fails at a stage: the coordinator drops them at the stage's
    deadline) are the test switches of the job, set for this run only."""
    options = {"epsilon": EPS, "delta": DELTA, "direction_clip_norm": CLIP,
               "mean_clip_norm": CLIP, "privacy_unit": "party",
               "preprocessing": {"scaling": "none"}, **options}  # fmt: skip
    with pytest.MonkeyPatch.context() as switches:
        if exact or silent:  # a switch names its job
            job_id = options.setdefault("job_id", f"slda-exact-{next(_EXACT_JOBS)}")
        if exact:
            switches.setenv(NOISELESS_VARIABLE, job_id)
        if silent:
            options.setdefault("stage_timeout", 10.0)  # what a silent site costs the run
            faults = {
                f"*:{stage}": dict.fromkeys(names, "raise") for stage, names in silent.items()
            }
            switches.setenv(FAULTS_VARIABLE, json.dumps({job_id: faults}))
        return sparse_lda([r.to_dict() for r in refs], workspace=str(workspace), **options)


def local_estimates(refs: list[TableRef], debiased: bool = True) -> list[Any]:
    return [fit_local(steps.read_party(r), LocalFitSettings(), debiased=debiased) for r in refs]


def audit_coordinator_inbox(channel: Channel, plain: list[np.ndarray]) -> None:
    """The coordinator got column names and secagg messages only, never a party's vector."""
    received = [r for r in channel.log() if r.receiver == secure_sum.COORDINATOR]
    assert {r.base_kind for r in received} == TO_COORDINATOR
    for record in received:
        message = codec.loads(channel.read_raw(record))
        for array in arrays_in(message):
            for vector in plain:
                assert secagg.encode(vector, len(HOSPITALS)).tobytes() not in array.tobytes()
                assert vector.tobytes() not in array.tobytes()
        if record.base_kind == "secagg_masked":
            masked = message["masked_input"].view(np.int64)
            assert np.mean(np.abs(masked) > 2.0**50) > 0.9  # uniform-looking, not small numbers


def stored_inputs(refs: list[TableRef], job_id: str) -> list[np.ndarray]:
    return [ArtifactStore(PartyStore.of(r)).get(steps.input_key(job_id)) for r in refs]


def spends(refs: list[TableRef]) -> list[list[dict[str, Any]]]:
    return [PrivacyLedger(PartyStore.of(r)).spends("patients") for r in refs]


def test_noiseless_average_equals_the_plain_average_of_debiased_fits(
    hospitals: Loader, workspace: Path
) -> None:
    refs = hospitals(workspace)
    result = run(refs, workspace, exact=True, **NO_THRESHOLD)

    estimates = local_estimates(refs)
    plain = [
        np.concatenate([e.debiased_direction, e.mean_positive, e.mean_negative]) for e in estimates
    ]
    average = np.mean(plain, axis=0)
    np.testing.assert_allclose(result["direction"], average[:30], rtol=0, atol=1e-7)
    np.testing.assert_allclose(result["mean_positive"], average[30:60], rtol=0, atol=1e-7)
    np.testing.assert_allclose(result["mean_negative"], average[60:], rtol=0, atol=1e-7)
    assert result["contributors"] == list(HOSPITALS) and result["total_rows"] == sum(ROWS.values())
    assert not result["private"] and all(not s for s in spends(refs))  # nothing charged

    # each party masked exactly its own vector, which stayed in its own store
    sent = [np.append(p, ROWS[r.party]) for p, r in zip(plain, refs, strict=True)]
    for stored, expected in zip(stored_inputs(refs, result["job_id"]), sent, strict=True):
        np.testing.assert_array_equal(stored, expected)
    audit_coordinator_inbox(channel_for(result["job_id"], str(workspace)), sent)
    for ref in refs:  # every party keeps the model; its session secrets are gone
        saved = ArtifactStore(PartyStore.of(ref)).get(steps.model_key(result["job_id"]))
        np.testing.assert_array_equal(saved["direction"], result["direction"])
        assert not ArtifactStore(PartyStore.of(ref)).list(f"sparse_lda/{result['job_id']}/secagg/")


def test_private_release_is_charged_once_and_reused_on_retry_and_rerun(
    hospitals: Loader, workspace: Path, fits: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = hospitals(workspace)
    real_put, failed = ArtifactStore.put, []

    def flaky_put(self: ArtifactStore, key: str, value: Any, kind: str, con: Any = None) -> None:
        if kind == "secure-sum-input" and "hospital_a" in str(self.store.path) and not failed:
            failed.append(key)
            raise OSError("disk hiccup")  # after the release was stored and charged
        real_put(self, key, value, kind, con)

    monkeypatch.setattr(ArtifactStore, "put", flaky_put)
    first = run(refs, workspace)
    assert failed and sorted(fits) == sorted(HOSPITALS)  # the retried step did not refit
    assert first["releases"]["hospital_a"]["reused"]  # the retry found its stored release
    assert first["private"] and first["contributors"] == list(HOSPITALS)
    charged = spends(refs)
    assert [[(s["epsilon"], s["delta"]) for s in party] for party in charged] == [
        [(EPS, DELTA)]
    ] * 3

    # the stored release is the clipped, gridded estimate plus one calibrated noise share
    calibration = steps.noise_calibration(
        steps.SparseLDAJob("j", HOSPITALS, "debiased", EPS, DELTA, CLIP, CLIP, 2), 30
    )
    assert first["noise_std_of_average"] == pytest.approx(calibration.average_std(3))
    noise = []
    for ref, estimate, stored in zip(
        refs, local_estimates(refs), stored_inputs(refs, first["job_id"]), strict=True
    ):
        release = PrivacyLedger(PartyStore.of(ref)).stored_release(
            first["releases"][ref.party]["release_key"]
        )
        np.testing.assert_array_equal(stored, np.append(release["vector"], ROWS[ref.party]))
        blocks = [clip_to_norm(estimate.debiased_direction, CLIP),
                  clip_to_norm(estimate.mean_positive, CLIP),
                  clip_to_norm(estimate.mean_negative, CLIP)]  # fmt: skip
        share = release["vector"] - round_to_grid(np.concatenate(blocks), 2.0**-24)
        assert np.all(np.ldexp(share, 24) == np.rint(np.ldexp(share, 24)))  # on the grid
        noise.append(share)
    assert np.std(np.concatenate(noise)) == pytest.approx(calibration.share_sigma, rel=0.25)
    audit_coordinator_inbox(
        channel_for(first["job_id"], str(workspace)), stored_inputs(refs, first["job_id"])
    )

    # a re-run of the same job reuses every stored release: no fit, no charge, same model
    again = run(refs, workspace)
    assert again["job_id"] == first["job_id"] and sorted(fits) == sorted(HOSPITALS)
    assert all(r["reused"] for r in again["releases"].values())
    assert spends(refs) == charged
    assert again["direction"] == first["direction"]


def test_noise_share_has_the_calibrated_scale() -> None:
    job = steps.SparseLDAJob("j", HOSPITALS, "debiased", EPS, DELTA, CLIP, CLIP, 2)
    calibration = steps.noise_calibration(job, 30)
    sensitivity = sum_sensitivity(job.privacy(), 30)
    assert calibration.sensitivity == sensitivity
    assert calibration.sigma == zcdp_sigma(EPS, DELTA, sensitivity)  # proven for discrete noise
    assert calibration.sigma > analytic_gaussian_sigma(EPS, DELTA, sensitivity)
    assert calibration.share_sigma == pytest.approx(calibration.sigma / math.sqrt(2))
    colluded = steps.noise_calibration(
        steps.SparseLDAJob("j", HOSPITALS, "debiased", EPS, DELTA, CLIP, CLIP, 3, 1), 30
    )
    assert colluded.share_sigma == pytest.approx(calibration.share_sigma)  # 3 - 1 = 2 shares

    draws = add_noise_share(np.zeros(40_000), calibration)  # one party's share alone
    assert np.all(np.ldexp(draws, 24) == np.rint(np.ldexp(draws, 24)))
    assert abs(draws.mean()) < 4 * calibration.share_sigma / math.sqrt(draws.size)
    assert draws.std() == pytest.approx(calibration.share_sigma, rel=0.02)
    # the threshold's two shares (the fewest the coordinator may unmask) carry sigma
    assert draws.reshape(-1, 2).sum(axis=1).std() == pytest.approx(calibration.sigma, rel=0.03)


def test_over_budget_or_no_budget_is_refused_before_any_computation(
    hospitals: Loader, workspace: Path, fits: list[str]
) -> None:
    refs = hospitals(workspace)
    PrivacyLedger(PartyStore.of(refs[1])).set_budget("patients", 0.5, DELTA)
    with pytest.raises(BudgetError, match=r"'patients'.*exceeds the budget"):
        run(refs, workspace, job_id="slda-over")
    with duckdb.connect(refs[2].database) as con:
        con.execute("DELETE FROM privreg_budget")
    with pytest.raises(BudgetError, match="no privacy budget is set"):
        run(refs, workspace, epsilon=0.4, job_id="slda-unset")
    assert fits == [] and all(not s for s in spends(refs))
    for job in ("slda-over", "slda-unset"):
        assert not [r for r in Channel(workspace, job).log() if r.base_kind.startswith("secagg")]


def _one_class(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(diagnosis=1)


def _renamed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.rename(columns={"mean_area": "mean_volume"})


def _all_flat(frame: pd.DataFrame) -> pd.DataFrame:
    features = [c for c in frame.columns if c not in ("patient_id", "diagnosis")]
    return frame.assign(**{c: 0.5 for c in features})


def _too_wide(frame: pd.DataFrame) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    wide = pd.DataFrame(rng.normal(size=(20, 2001)), columns=[f"x{i}" for i in range(2001)])
    return pd.concat([frame.iloc[:20, :2].reset_index(drop=True), wide], axis=1)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (_one_class, MissingClassError, "party 'hospital_c' has 0 rows with label 0"),
        (_too_wide, DimensionLimitError, "party 'hospital_c': 2001 features exceeds .* 2000"),
        (_renamed, ColumnMismatchError, r"party 'hospital_c'.*missing \['mean_area'\]"),
        (_all_flat, DegenerateDataError, r"party 'hospital_c': every column is constant"),
    ],
)
def test_bad_tables_are_refused_before_any_computation(
    hospitals: Loader,
    workspace: Path,
    fits: list[str],
    change: Any,
    error: type[Exception],
    message: str,
) -> None:
    demo = pd.read_csv(ROOT / "demo" / "horizontal" / "hospital_c.csv")
    refs = hospitals(workspace, {"hospital_c": change(demo)})
    with pytest.raises(error, match=message):
        run(refs, workspace, job_id="slda-bad")
    assert fits == [] and all(not s for s in spends(refs))
    assert not [r for r in Channel(workspace, "slda-bad").log() if r.base_kind.startswith("secagg")]


def test_row_unit_takes_a_site_with_one_class_and_refuses_a_class_missing_everywhere(
    hospitals: Loader, workspace: Path
) -> None:
    """The party unit refuses hospital_c's cases-only table (above); the row unit sums it, so
    the model is the plain moments fit of all rows, and no site was refused by its labels."""
    demo = {n: pd.read_csv(ROOT / "demo" / "horizontal" / f"{n}.csv") for n in HOSPITALS}
    refs = hospitals(workspace, {"hospital_c": _one_class(demo["hospital_c"])})
    options = {"privacy_unit": "row", "row_clip_norm": 3.0, "exact": True}
    exact = run(refs, workspace, **options)
    assert exact["contributors"] == list(HOSPITALS)
    parties = [steps.read_party(r, exact["features"]) for r in refs]
    plain = PrivacySettings.row_level(EPS, DELTA, 3.0, noise_disabled_for_testing=True)
    expected = fit_moments_release(parties, plain)
    np.testing.assert_allclose(exact["direction"], expected.direction, rtol=0, atol=1e-6)

    refs = hospitals(workspace, {n: _one_class(frame) for n, frame in demo.items()})
    with pytest.raises(MissingClassError, match=r"0\.0 rows with label 0;.* over all parties"):
        run(refs, workspace, job_id="slda-cases-only", **options)
    assert all(not s for s in spends(refs))


def test_bad_options_are_refused(hospitals: Loader, workspace: Path) -> None:
    refs = hospitals(workspace)
    with pytest.raises(ParameterTypeError, match="method: Input should be 'debiased'"):
        run(refs, workspace, method="average")
    with pytest.raises(steps.SparseLDASetupError, match="colluding_parties = 2"):
        run(refs, workspace, colluding_parties=2)
    with pytest.raises(ParameterTypeError, match="delta: Input should be greater than 0"):
        run(refs, workspace, delta=0.0)


def test_naive_and_pooled_reference_methods(hospitals: Loader, workspace: Path) -> None:
    refs = hospitals(workspace)
    naive = run(refs, workspace, method="naive", exact=True)
    biased = np.mean([e.sparse_direction for e in local_estimates(refs, debiased=False)], axis=0)
    np.testing.assert_allclose(naive["direction"], biased, rtol=0, atol=1e-7)
    assert naive["hard_threshold"] == 0.0

    pooled = run(refs, workspace, method="centralized_reference")
    reference = fit_centralized([steps.read_party(r) for r in refs])
    np.testing.assert_allclose(pooled["direction"], reference.direction, rtol=0, atol=1e-12)
    assert not pooled["private"] and all(not s for s in spends(refs))
    kinds = {r.base_kind for r in channel_for(pooled["job_id"], str(workspace)).log()}
    assert "rows_not_private" in kinds and not any(k.startswith("secagg") for k in kinds)


def test_a_party_dropping_out_leaves_the_average_of_the_others(
    hospitals: Loader, workspace: Path
) -> None:
    refs = hospitals(workspace)
    result = run(
        refs,
        workspace,
        threshold=2,
        exact=True,
        silent={"mask_input": ["hospital_c"]},
        **NO_THRESHOLD,
    )
    survivors = local_estimates(refs[:2])
    expected = np.mean([e.debiased_direction for e in survivors], axis=0)
    np.testing.assert_allclose(result["direction"], expected, rtol=0, atol=1e-7)
    assert result["contributors"] == ["hospital_a", "hospital_b"]
    assert result["total_rows"] == ROWS["hospital_a"] + ROWS["hospital_b"]


def test_a_column_flat_at_every_party_is_refused_before_any_charge(
    hospitals: Loader, workspace: Path, fits: list[str]
) -> None:
    frames = {
        name: pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv").assign(mean_area=0.0)
        for name in HOSPITALS
    }
    refs = hospitals(workspace, frames)
    with pytest.raises(DegenerateDataError, match=r"column 'mean_area' is constant .* every party"):
        run(refs, workspace, job_id="slda-flat")
    assert fits == [] and all(not s for s in spends(refs))
    assert not [r for r in Channel(workspace, "slda-flat").log() if r.kind.startswith("secagg")]


def test_row_level_release_is_the_plain_moments_fit_and_reports_held_out_figures(
    hospitals: Loader, workspace: Path
) -> None:
    refs = hospitals(workspace)
    options = {"privacy_unit": "row", "row_clip_norm": 3.0, "holdout_fraction": 0.2}
    exact = run(refs, workspace, exact=True, **options)
    job = steps.SparseLDAJob("x", HOSPITALS, "debiased", EPS, DELTA, None, None, 2,
                             holdout_fraction=0.2)  # fmt: skip
    parties = [steps.read_party(r, exact["features"], job) for r in refs]
    plain = PrivacySettings.row_level(EPS, DELTA, 3.0, noise_disabled_for_testing=True)
    expected = fit_moments_release(parties, plain)
    np.testing.assert_allclose(exact["direction"], expected.direction, rtol=0, atol=1e-6)
    held_out = sum(len(job.holdout_rows(n)) for n in ROWS.values())
    assert exact["total_rows"] == sum(ROWS.values()) - held_out
    assert exact["figures"]["holdout_rows"] == held_out
    tests = [steps.read_holdout(r, exact["features"], job) for r in refs]
    test_x, test_y = np.vstack([t[0] for t in tests]), np.concatenate([t[1] for t in tests])
    assert exact["figures"]["holdout_error"] == pytest.approx(expected.error_rate(test_x, test_y))
    quality = {q["metric"]: q for q in PUBLISHED[exact["job_id"]]["quality"]}
    summary = quality["held-out misclassification"]  # the run summary's line: parties' counts
    assert summary["model"] == pytest.approx(exact["figures"]["holdout_error"])
    positive = float(np.mean(test_y))
    assert summary["baseline"] == pytest.approx(min(positive, 1.0 - positive))
    assert all(not s for s in spends(refs))

    with pytest.MonkeyPatch.context() as switches:  # a switch naming another job: no effect
        switches.setenv(NOISELESS_VARIABLE, exact["job_id"])
        private = run(refs, workspace, **options)
    figures = private["figures"]
    assert figures["privacy_unit"] == "row" and figures["epsilon"] == EPS
    assert figures["features_kept"] > 0 and 0.0 <= figures["holdout_error"] < 0.25
    assert summary_line(private).startswith("pooled moments, row-level eps 1, ")
    assert [len(s) for s in spends(refs)] == [1, 1, 1]
    row_job = replace(job, privacy_unit="row", row_clip_norm=3.0)
    calibration = steps.noise_calibration(row_job, 30)  # the core's, for t - c = 2 shares
    assert calibration == calibrate(row_job.privacy(), 30, 2)
    sensitivity = sum_sensitivity(row_job.privacy(), 30)
    assert calibration.share_sigma == pytest.approx(zcdp_sigma(EPS, DELTA, sensitivity) / 2**0.5)


def test_pooled_scaling_gives_raw_columns_the_standardised_model_and_scoring_applies_it(
    hospitals: Loader, workspace: Path
) -> None:
    """Default preprocessing: the pooled mean and variance of one secure sum standardise every
    party's rows, so hospitals whose columns are the demo's times 1e3 plus 500 get the demo
    columns' model and quality (on stored values the same job clips every raw row to the norm
    bound: a held-out error of 0.33, worse than the majority class, when tried). The
    statistics travel with each hospital's copy: scoring the raw rows equals scoring the demo
    rows, and says which rows trained and were held out."""
    options = {"privacy_unit": "row", "row_clip_norm": 3.0, "holdout_fraction": 0.2,
               "exact": True, "preprocessing": None}  # fmt: skip
    demo_refs = hospitals(workspace / "demo")
    demo = run(demo_refs, workspace / "demo", **options)
    raw_frames = {}
    for name in HOSPITALS:
        frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")
        columns = [c for c in frame.columns if c not in ("patient_id", "diagnosis")]
        frame[columns] = frame[columns] * 1e3 + 500.0
        raw_frames[name] = frame
    raw_refs = hospitals(workspace / "raw", raw_frames)
    raw = run(raw_refs, workspace / "raw", **options)
    np.testing.assert_allclose(raw["direction"], demo["direction"], rtol=0, atol=1e-6)
    assert raw["figures"]["holdout_error"] == demo["figures"]["holdout_error"] < 0.1

    for demo_ref, raw_ref in zip(demo_refs, raw_refs, strict=True):
        with disable_run_logger():
            on_demo = local_scores.fn(demo_ref, steps.model_key(demo["job_id"]))
            on_raw = local_scores.fn(raw_ref, steps.model_key(raw["job_id"]))
        scored = TableRef(
            demo_ref.database, "patients_scored", "patient_id", feature_columns=("score",)
        )
        read = [PartyStore.of(r).read_table(replace(scored, database=r.database))
                for r in (demo_ref, raw_ref)]  # fmt: skip
        np.testing.assert_allclose(read[1]["score"], read[0]["score"], rtol=0, atol=1e-6)
        held_out = len(steps.SparseLDAJob(
            "x", HOSPITALS, "debiased", EPS, DELTA, None, None, 2, holdout_fraction=0.2
        ).holdout_rows(ROWS[raw_ref.party]))  # fmt: skip
        expected = {"train": ROWS[raw_ref.party] - held_out, "held out": held_out, "unseen": 0}
        assert on_raw.in_training == on_demo.in_training == expected


def _with_gaps(seed: int) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """The demo hospitals with 9 missing cells in each of three columns, and hospital_b's
    first three ``mean_radius`` values a disguised missing 0 (the job declares 0 missing)."""
    rng = np.random.default_rng(seed)
    frames = {}
    for name in HOSPITALS:
        frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")
        columns = [c for c in frame.columns if c not in ("patient_id", "diagnosis")][:3]
        for column in columns:
            frame.loc[rng.choice(len(frame), 9, replace=False), column] = np.nan
        frames[name] = frame
    frames["hospital_b"].loc[[0, 1, 2], columns[0]] = 0.0
    return frames, columns


def test_missing_cells_are_imputed_with_the_pooled_statistics_and_scoring_imputes_alike(
    hospitals: Loader, workspace: Path
) -> None:
    """The fill (median) and the scaling (mean, deviation) are the pooled training rows'
    statistics in the clear (the median to within one bin of the public grid), the model is
    the moments fit of the rows imputed by hand, and scoring new rows with missing cells
    applies the same transform. (Mean and constant fills come from the same fitted record:
    ``tests/test_preprocessing.py``.)"""
    frames, columns = _with_gaps(7)
    job = {"impute": "median", "missing_values": {columns[0]: [0]}}
    refs = hospitals(workspace, frames, PreprocessingSpec.from_dict(job))
    options = {"privacy_unit": "row", "row_clip_norm": 3.0, "holdout_fraction": 0.2,
               "exact": True, "preprocessing": job}  # fmt: skip
    result = run(refs, workspace, **options)
    split = steps.SparseLDAJob("x", HOSPITALS, "debiased", EPS, DELTA, None, None, 2,
                               holdout_fraction=0.2)  # fmt: skip
    train = {n: f.iloc[split.train_rows(len(f))] for n, f in frames.items()}
    clear = {
        n: f[result["features"]].replace({columns[0]: {0.0: np.nan}}) for n, f in train.items()
    }
    truth = pd.concat(clear.values())

    fitted = FittedPreprocessing.from_dict(result["preprocessing"])
    assert fitted.rows == len(truth) == result["total_rows"]
    for stats in fitted.columns:
        observed = np.sort(truth[stats.name].dropna().to_numpy())
        assert stats.missing == len(truth) - len(observed)
        # to the secure sum's fixed point (2^-24 per party's sum)
        assert stats.center == pytest.approx(observed.mean(), rel=1e-9, abs=1e-8)
        assert stats.scale == pytest.approx(observed.std(), rel=1e-6, abs=1e-6)
        half, width = len(observed) // 2, 16 * stats.scale / 1024  # one bin of the grid
        assert observed[half - 1] - width <= stats.fill <= observed[half] + width
    assert all(c.missing > 0 for c in fitted.columns[:3])

    parties = [
        PartyData(n, fitted.transform(clear[n].to_numpy()), f["diagnosis"].to_numpy(),
                  tuple(result["features"]))
        for n, f in train.items()
    ]  # fmt: skip
    plain = PrivacySettings.row_level(EPS, DELTA, 3.0, noise_disabled_for_testing=True)
    expected = fit_moments_release(parties, plain)
    np.testing.assert_allclose(result["direction"], expected.direction, rtol=0, atol=1e-6)
    assert result["figures"]["holdout_error"] < 0.1

    new = frames["hospital_a"].head(6).assign(patient_id=lambda f: f["patient_id"] + 10**6)
    new.loc[0, columns[0]], new.loc[1, columns[1]], new.loc[2, columns[0]] = 0.0, np.nan, np.nan
    new_ref = TableRef(refs[0].database, "new_patients", "patient_id", "diagnosis")
    PartyStore.of(new_ref).import_frame(new, new_ref, PreprocessingSpec.from_dict(job))
    with disable_run_logger():
        local_scores.fn(new_ref, steps.model_key(result["job_id"]))
    X = new[result["features"]].replace({columns[0]: {0.0: np.nan}}).to_numpy(dtype=float)
    X = np.where(np.isnan(X), [c.fill for c in fitted.columns], X)
    X = (X - [c.center for c in fitted.columns]) / [c.scale for c in fitted.columns]
    by_hand = X @ np.asarray(result["direction"]) + result["intercept"]
    with PartyStore.of(new_ref).connect() as con:
        scored = con.execute('SELECT score FROM "new_patients_scored"').df()["score"]
    np.testing.assert_allclose(scored.to_numpy(), by_hand, rtol=0, atol=1e-9)


def test_missing_cells_without_an_imputation_are_refused_naming_every_column(
    hospitals: Loader, workspace: Path, fits: list[str]
) -> None:
    frames, columns = _with_gaps(7)
    refs = hospitals(workspace, frames)  # stored with their gaps
    listed = r".*".join(rf"column '{c}': 9 of \d+ rows" for c in columns)
    with pytest.raises(
        MissingValuesError, match=rf"3 column\(s\): {listed}.*preprocessing\.impute"
    ):
        run(refs, workspace, job_id="slda-gaps", preprocessing=None)
    assert fits == [] and all(not s for s in spends(refs))


def test_a_site_fetches_the_sum_call_while_it_computes_its_release(tmp_path: Path) -> None:
    """The call, sent when the pooled statistics are in, is asked for in the background as
    the release's computation starts (the flow's order), not a round trip after it."""
    log = FetchLog(tmp_path, "hospital_a")
    site = SimpleNamespace(
        endpoint=Channel(tmp_path, "lda", log, timeout=5.0).endpoint("hospital_a")
    )
    coordinator = Channel(tmp_path, "lda").endpoint(secure_sum.COORDINATOR)
    coordinator.send("hospital_a", "sum_call", {"session_id": "lda/1"})
    party_steps.prefetch_sum_call(site)
    deadline = time.monotonic() + 5.0
    while not log.asked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.asked == ["sum_call"]
