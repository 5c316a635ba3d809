"""The summary's warnings and tables, as pure functions (the flows' runs test the rest)."""

from __future__ import annotations

import re
import time
import types
from pathlib import Path

import numpy as np
import pytest

from core.model_format import ModelFormatError, ModelRecord
from tasks import reporting
from tasks.reporting import (
    LOSS_NOISE,
    BudgetLine,
    Quality,
    RunSummary,
    human_bytes,
    markdown_table,
    model_table,
    round_warnings,
    short_id,
    summary_markdown,
)
from tasks.summaries import classifier_figures, holdout_scope, holdout_split, horizontal_quality


def test_a_rising_loss_and_a_diverging_gradient_are_warned_about() -> None:
    falling = [{"round": r, "loss": 0.7 - 0.1 * r, "gradient_norm": 1.0} for r in range(4)]
    assert round_warnings(falling) == []
    rising = [*falling, {"round": 4, "loss": 0.45, "gradient_norm": 1.0}]
    [warning] = round_warnings(rising)
    assert "loss rose in the last round" in warning and "round 4" in warning
    diverging = [*falling, {"round": 4, "loss": 0.2, "gradient_norm": 50.0}]
    [warning] = round_warnings(diverging)
    assert "gradient diverges" in warning
    # under DP a rise within the loss's noise is not one: the rounds table says how noisy
    noisy = [{**r, LOSS_NOISE: 0.1} for r in rising]
    assert round_warnings(noisy) == []
    assert round_warnings([*noisy[:-1], {**noisy[-1], "loss": 0.9}])


def test_a_table_cell_with_a_bar_or_a_line_break_is_shown_whole() -> None:
    """An unescaped ``|`` or line break ends a markdown cell early: the rest is cut off."""
    text = "refused: a | b\nsee the log"
    table = markdown_table([{"party": "lab", "result": text}])
    _header, rule, row = table.split("\n")
    assert row == "| lab | refused: a \\| b<br>see the log |"
    cells = re.split(r"(?<!\\)\|", row)[1:-1]
    assert len(cells) == len(rule.strip("|").split("|")) == 2


def test_quality_below_the_baseline_respects_the_metric_s_direction() -> None:
    assert Quality("AUC", 0.45, 0.5, True).below_baseline()
    assert not Quality("AUC", 0.9, 0.5, True).below_baseline()
    assert Quality("log-loss", 0.8, 0.69, False).below_baseline()
    assert not Quality("MSE", None, 10.0, False).below_baseline()


def test_the_summary_holds_every_figure() -> None:
    summary = RunSummary(
        "walr-0123456789abcdef",
        {"lab": 470, "clinic": 470},
        quality=[Quality("AUC", 0.91, 0.5, True, "held-out rows")],
        budgets=[BudgetLine("clinic", "patients", 1.0, 3.0, 1e-5)],
        bytes_sent={"lab": 1234, "clinic": 567},
        rounds=1,
        seconds=2.5,
    )
    text = summary_markdown(summary, "demo", "walr")
    for figure in (
        "| job | demo |",
        "| flow | walr |",
        "| lab | 470 | 1.2 KiB |",
        "| AUC | 0.91 | 0.5 | held-out rows | higher |",
        "| clinic | patients | 1.0 | 3.0 | 1e-05 |",
        "| rounds | 1 |",
        "| wall time (s) | 2.5 |",
    ):
        assert figure in text, figure


def test_a_summary_says_each_figure_in_plain_words_first_its_parameter_in_brackets() -> None:
    summary = RunSummary(
        "sparse-lda-0123456789abcdef",
        {"hospital_a": 240},
        quality=[Quality("log-loss at hospital_a", 0.3, 0.69, False, "48 held-out rows"),
                 Quality("held-out misclassification", 0.1, 0.4, False, "48 held-out rows")],
        budgets=[BudgetLine("hospital_a", "patients", 1.0, 3.0, 1e-5)],
    )  # fmt: skip
    text = summary_markdown(summary, "demo", "sparse-lda")
    budget = text.split("## Privacy budget", 1)[1]
    assert "lower is more private" in budget.split("|", 1)[0]  # a sentence before the table
    assert (
        "| party | protected table | privacy used so far (epsilon spent) | privacy still to "
        "spend (epsilon left) | chance the guarantee fails (at the owner's delta) |"
    ) in budget
    assert "| lower | how far the predicted probabilities are from the labels |" in text
    assert "| lower | the share of rows put in the wrong class |" in text
    lines = reporting._stage_lines(summary, "demo", "sparse-lda")
    assert lines[1] == (
        "quality: probability error (log-loss at hospital_a 0.3, baseline 0.69, 48 held-out "
        "rows); wrong class (held-out misclassification 0.1, baseline 0.4, 48 held-out rows)"
    )
    assert lines[2] == (
        "privacy of hospital_a.patients: used so far (epsilon spent 1), still to spend "
        "(epsilon left 3), chance the guarantee fails (the owner's delta 1e-05)"
    )
    assert reporting.plain_metric("AUC at hospital_b")[0] == "ranking"


def test_model_tables_read_the_common_format_and_bytes_carry_a_unit() -> None:
    guest = ModelRecord.linear("vertical", "v", ["age"], [-1.0], 0.5, party="c", share=True)
    assert model_table(guest.to_dict()) == ([{"feature": "age", "coefficient": -1.0}], 0.5)
    whole = ModelRecord.linear("walr", "w", ["age"], np.array([2.0]), -0.25)
    assert model_table(whole.to_dict()) == ([{"feature": "age", "coefficient": 2.0}], -0.25)
    with pytest.raises(ModelFormatError):  # an old record is refused, not half read
        model_table({"coefficients": {"age": 2.0}, "intercept": -0.25})
    assert [human_bytes(n) for n in (512, 1536, 5 * 2**20, 3 * 2**30)] == [
        "512 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"
    ]  # fmt: skip
    assert short_id("vertical-0123456789abcdef") == "01234567" == short_id("0123456789abcdef")
    assert short_id("retried") == "retried"  # an explicit job id stays whole


def test_held_out_figures_are_labelled_and_pool_by_rows() -> None:
    train, held_out = holdout_split(10, 0.3, "job-a")
    assert sorted([*train, *held_out]) == list(range(10)) and len(held_out) == 3
    assert np.array_equal(holdout_split(10, 0.3, "job-a")[1], held_out)  # seeded: agreed
    assert holdout_split(10, 0.0, "job-a")[1].size == 0
    labels = np.array([1.0, 0.0, 1.0, 1.0])
    figures = classifier_figures(labels, np.array([0.9, 0.2, 0.6, 0.7]), training_rate=0.5)
    assert figures["auc"] == 1.0 and figures["baseline_auc"] == 0.5
    assert figures["baseline_log_loss"] == pytest.approx(np.log(2))  # the class prior 0.5
    a = {**figures, "scope": holdout_scope(4, 20)}
    b = {**figures, "evaluated_rows": 12, "log_loss": 0.5, "scope": holdout_scope(12, 60)}
    quality = {q.metric: q for q in horizontal_quality({"a": a, "b": b})}
    pooled = quality["log-loss, pooled"]
    assert pooled.model == pytest.approx((4 * figures["log_loss"] + 12 * 0.5) / 16)
    assert pooled.rows == "16 held-out rows of all parties"
    assert quality["AUC at b"].rows == "b's 12 held-out rows"
    assert holdout_scope(0, 20) == "all 20 training rows (in-sample)"


@pytest.mark.usefixtures("prefect_server")
def test_a_party_flow_is_named_by_its_agreed_job_id_and_its_own_table() -> None:
    from prefect import flow

    from tasks.reporting import artifact_key, run_namer

    @flow(name="walr_party", flow_run_name=run_namer("walr_party"))
    def walr_party(own: dict, job_id: str) -> tuple[str, str]:
        from prefect.runtime import flow_run

        return flow_run.name, artifact_key("walr", "summary")

    own = {"database": "x/advertiser.duckdb", "table": "conversions", "party": "advertiser"}
    name, key = walr_party(own, "Q3 Conversions")
    assert key == "q3-conversions-walr-summary"  # not a placeholder job name
    assert name.startswith("q3-conversions ") and name.endswith(": advertiser.conversions")


def test_progress_is_shown_at_most_once_a_second_and_always_at_the_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    shown: list[float] = []
    monkeypatch.setattr(reporting, "create_progress_artifact", lambda **_: "bar")
    monkeypatch.setattr(
        reporting, "update_progress_artifact", lambda _, progress: shown.append(progress)
    )
    monkeypatch.setattr(reporting, "get_run_logger", lambda: logging.getLogger("test"))
    clock = iter([0.0, 0.3, 0.6, 1.2, 1.3, 1.4])  # seconds at each update
    # reporting's own clock only: patching time.monotonic itself fed this clock to any other
    # thread of the process that read the time meanwhile, and the test failed now and then
    fake_time = types.SimpleNamespace(monotonic=lambda: next(clock), time=time.time)
    monkeypatch.setattr(reporting, "time", fake_time)
    caplog.set_level(logging.INFO, logger="test")
    bar = reporting.Progress(6, "rounds")
    for done in range(1, 7):
        bar.update(done)
    assert shown == [100 / 6, 400 / 6, 100.0]  # the first, the one a second later, the end
    # a count of rounds done, never read as a round number (rounds are numbered from 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "test"]
    assert lines == [f"progress: {n} of 6 rounds done" for n in (1, 4, 6)]


@pytest.mark.usefixtures("prefect_server")
def test_a_run_outside_a_deployment_names_its_job_without_asking_the_api_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect import flow
    from prefect.runtime import deployment

    from tasks.reporting import job_name

    fetched: list[str] = []
    fetch = deployment._get_flow_run

    async def counted(run_id: str):  # type: ignore[no-untyped-def]
        fetched.append(run_id)
        return await fetch(run_id)

    monkeypatch.setattr(deployment, "_get_flow_run", counted)

    @flow(name="walr_party")
    def walr_party(job_id: str) -> list[str]:
        return [job_name() for _ in range(5)]

    assert walr_party("Q3 Conversions") == ["q3-conversions"] * 5
    assert fetched == []  # the run's context says it has no deployment


@pytest.mark.usefixtures("prefect_server")
def test_a_stage_reports_under_its_job_and_its_steps_carry_no_tags() -> None:
    """A job's stages are named for the job (``job_named``), not tagged: a tagged task run
    asks the server for its tags' concurrency slots before it starts."""
    from prefect import flow, task
    from prefect.context import TaskRunContext

    from tasks.reporting import job_name, job_named

    @task
    def step() -> list[str]:
        run = TaskRunContext.get().task_run
        return list(run.tags)

    @flow(name="walr_party")
    def walr_party(job_id: str) -> tuple[str, list[str]]:
        return job_name(), step()

    with job_named("Nightly Credit"):
        assert walr_party("demo-walr") == ("nightly-credit", [])
    assert walr_party("demo-walr")[0] == "demo-walr"  # outside a job: its agreed id


def test_a_party_s_rounds_table_counts_its_own_traffic_per_round_in_party_mode(
    tmp_path: Path,
) -> None:
    """A party at its own organisation (mTLS transport, its own folder) reads its bytes per
    round from what its folder holds: real figures, not the 0 KiB of a channel it cannot see."""
    from types import SimpleNamespace

    from federation import certs
    from federation.party_config import PartyConfig, as_party
    from federation.workspace import channel_for
    from storage.artifacts import ArtifactStore
    from storage.party_store import PartyStore
    from tasks.summaries import vertical_round_history

    ca = certs.create_ca(tmp_path / "ca")
    own = certs.issue(ca, "clinic", tmp_path / "clinic")
    config = PartyConfig("clinic", tmp_path / "clinic", "127.0.0.1:0", ca.cert, own.cert,
                         own.key, peers={"lab": "localhost:1"})  # fmt: skip
    database = tmp_path / "clinic.duckdb"
    artifacts = ArtifactStore(PartyStore(database))
    for round_, loss in enumerate([0.69, 0.5]):
        artifacts.put(f"vertical/job-1/loss/{round_:07d}", loss, "metric")
    with as_party(config):
        endpoint = channel_for("job-1").endpoint("clinic")
        assert type(endpoint.channel.transport).__name__ == "GrpcTransport"
        for round_, size in enumerate([1000, 3000]):
            endpoint.send("lab", "u", np.arange(float(size)), round=round_)
        table = vertical_round_history(
            SimpleNamespace(job_id="job-1", key_holder_database=database)
        )
    assert [row["round"] for row in table] == [0, 1]
    sent = [row["KiB sent"] for row in table]
    assert sent[0] == pytest.approx(8 * 1000 / 1024, abs=0.2)  # the array and its envelope
    assert sent[1] == pytest.approx(8 * 3000 / 1024, abs=0.2)


def test_a_sparse_lda_summary_says_how_the_model_was_fitted_in_plain_words() -> None:
    from types import SimpleNamespace

    from tasks.summaries import sparse_lda_fit

    party = SimpleNamespace(row_unit=False, method="debiased")
    assert sparse_lda_fit(party) == (
        "how the model was fitted (method debiased)",
        "each party's own fit, debiased, then averaged",
    )
    reference = SimpleNamespace(row_unit=False, method="centralized_reference")
    assert "(not private)" in sparse_lda_fit(reference)[1]
    row = SimpleNamespace(row_unit=True, method="debiased")  # method: party unit only
    assert sparse_lda_fit(row)[0] == "how the model was fitted (privacy unit row)"
