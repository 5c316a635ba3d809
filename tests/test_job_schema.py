"""Job files are validated in full before anything is loaded: typos are refused by name with the
closest valid key, the flows take the schema's models, and the docs' job-file reference is the
schema's own text."""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect import Flow
from pydantic import BaseModel

from core import job_schema as schema
from core.job_files import load_job, read_job
from flows.job_reference import BEGIN, PAGE, markdown, section
from privreg.cli import build_parser, main
from storage.descriptor import TableRef

ROOT = Path(__file__).resolve().parents[1]
DEMO = json.loads((ROOT / "jobs/demo.json").read_text())


def _with(change: Callable[[dict[str, Any]], Any], base: dict[str, Any] = DEMO) -> dict[str, Any]:
    job = copy.deepcopy(base)
    change(job)
    return job


def _rename(section: dict[str, Any], old: str, new: str) -> None:
    section[new] = section.pop(old)


# every class of typo: (the job file, words its refusal must contain)
TYPOS = {
    "stage": (_with(lambda j: _rename(j, "vertical", "vertcal")), ["vertcal", "'vertical'"]),
    "option": (
        _with(lambda j: _rename(j["vertical"], "epochs", "epoch")),
        ["vertical.epoch", "'epochs'"],
    ),
    "role": (_with(lambda j: _rename(j["parties"], "host", "hots")), ["parties.hots", "'host'"]),
    "type": (
        _with(lambda j: j["vertical"].update(batch_size="512")),
        ["vertical.batch_size", "valid integer", "'512'"],
    ),
    "range": (_with(lambda j: j["walr"].update(epsilon=0)), ["walr.epsilon", "greater than 0"]),
    "table key": (
        _with(lambda j: _rename(j["parties"]["guest"]["table"], "id_column", "id_colum")),
        ["parties.guest.table.id_colum", "'id_column'"],
    ),
    "party preprocessing": (
        _with(lambda j: j["parties"]["host"].update(preprocessing={"impute": "mean"})),
        ["parties.host.preprocessing.impute", "missing_values and categorical"],
    ),
}


def _in_folder(tmp_path: Path, job: dict[str, Any]) -> tuple[Path, list[Path]]:
    """The job with its databases in ``tmp_path`` (none exists yet) and sources from the
    repository; returns the file and the database paths."""
    databases = []
    for entry in job["parties"].values():
        entry["source"] = str(ROOT / entry["source"])
        database = tmp_path / Path(entry["table"]["database"]).name
        entry["table"]["database"] = str(database)
        databases.append(database)
    job.pop("subjobs", None)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return path, databases


@pytest.mark.parametrize("typo", list(TYPOS))
def test_a_typo_is_refused_before_anything_is_loaded(
    typo: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, words = TYPOS[typo]
    path, databases = _in_folder(tmp_path, copy.deepcopy(job))
    for argv in (["run", str(path)], ["job", "check", str(path)]):
        assert main(argv) == 1
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert 2 <= len(lines) <= schema.MAX_LINES, captured.err
        assert lines[0] == f"privreg: error: job file {path} (main job) is refused:"
        assert all(word in captured.err for word in words), captured.err
        assert "Traceback" not in captured.err and captured.out == ""
    assert not any(database.exists() for database in databases)  # nothing was loaded


def test_many_problems_fit_in_five_lines(tmp_path: Path) -> None:
    job = _with(lambda j: j["vertical"].update({k: "x" for k in j["vertical"]}))
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    with pytest.raises(schema.JobFileError) as refused:
        read_job(path)
    lines = str(refused.value).splitlines()
    assert len(lines) == schema.MAX_LINES and lines[-1] == "  ... and 4 more"


def test_every_bundled_job_file_validates_and_names_its_kind() -> None:
    kinds = {path.name: type(load_job(path)) for path in (ROOT / "jobs").glob("*.json")}
    assert kinds == {
        "demo.json": schema.MainJob,
        "label_dp_demo.json": schema.LabelDPJob,
        "horizontal_demo.json": schema.HorizontalJob,
        "sparse_lda_demo.json": schema.SparseLDAJob,
        "score_demo.json": schema.ScoreVerticalJob,
    }
    with pytest.raises(schema.JobFileError, match="horizontal_lr sub-job file where a main job"):
        read_job(ROOT / "jobs/horizontal_demo.json", "main")


def test_the_pipelines_validate_their_job_file_at_flow_start(tmp_path: Path) -> None:
    """Deployments pass ``job_file``: the flow's own first step refuses a bad one (sub-jobs
    included) before it loads anything."""
    from flows.pipeline import pipeline

    bad_sub = _with(lambda j: _rename(j["horizontal_lr"], "rounds", "round"),
                    json.loads((ROOT / "jobs/horizontal_demo.json").read_text()))  # fmt: skip
    (tmp_path / "sub.json").write_text(json.dumps(bad_sub))
    path, databases = _in_folder(tmp_path, copy.deepcopy(DEMO))
    main_job = json.loads(path.read_text())
    main_job["subjobs"] = {"horizontal_lr": str(tmp_path / "sub.json")}
    path.write_text(json.dumps(main_job))
    with pytest.raises(schema.JobFileError, match=r"horizontal_lr.round: .*'rounds'"):
        pipeline.fn(str(path), workspace=str(tmp_path))
    assert not any(database.exists() for database in databases)


def test_job_check_prints_every_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_with(lambda j: (j.pop("subjobs"), j.pop("walr")))))
    assert main(["job", "check", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["vertical"]["tol"] == 1e-5 and printed["vertical"]["randomizer"] == "full"
    assert printed["vertical"]["epochs"] == 4  # the file's own value
    assert printed["psi"]["min_rows"] == 100 and printed["walr"] is None
    assert printed["parties"]["host"]["table"]["label_column"] is None


def test_the_docs_reference_is_generated_from_the_schema(
    capsys: pytest.CaptureFixture[str],
) -> None:
    page = (ROOT / PAGE).read_text()
    assert BEGIN in page, f"{PAGE} lacks the job-file reference markers"
    assert section(page) == markdown(), "regenerate: python -m flows.job_reference"
    assert main(["job", "schema", "--markdown"]) == 0
    assert capsys.readouterr().out == markdown()


def test_the_table_descriptor_has_the_fields_of_table_ref() -> None:
    assert set(schema.TableDescriptor.model_fields) == set(TableRef.__dataclass_fields__)


def test_job_level_keys_follow_their_readers() -> None:
    from core.preprocessing import PreprocessingSpec
    from federation.status import RESTART_GRACE

    assert schema.MainJob.model_fields["restart_grace"].default == RESTART_GRACE
    assert set(schema.Preprocessing.model_fields) == set(PreprocessingSpec.__dataclass_fields__)
    defaults = schema.Preprocessing().model_dump()
    spec = PreprocessingSpec()
    assert {k: getattr(spec, k) for k in ("scaling", "impute", "fill_value")} == {
        k: defaults[k] for k in ("scaling", "impute", "fill_value")
    }


# ---- the schema is what the flows take ----------------------------------------------------------
#: Each stage's model, and the side flows that take it whole as their ``options``.
STAGE_FLOWS: dict[type, list[str]] = {
    schema.PsiOptions: ["psi_align_party"],
    schema.VerticalOptions: ["vertical_lr_party"],
    schema.WalrOptions: ["walr_party"],
    schema.LabelDPOptions: ["label_dp_party"],
    schema.HorizontalOptions: ["horizontal_lr_party", "horizontal_lr_coordinator"],
    schema.SparseLDAOptions: ["sparse_lda_party", "sparse_lda_coordinator"],
    schema.ScoreOptions: ["score_vertical_party"],
}


def test_every_side_flow_takes_its_stage_model_as_one_validated_parameter() -> None:
    """Issue 35.5: an option is declared once, in its model; Prefect validates a side flow's
    ``options`` from it (a dict from a deployment form becomes the model, a bad value fails)."""
    flows = _user_facing_flows()
    for model, names in STAGE_FLOWS.items():
        for name in names:
            schema_of = flows[name].parameters.model_dump()
            assert schema_of["properties"]["options"]["$ref"].endswith(model.__name__), name
            assert set(schema_of["definitions"][model.__name__]["properties"]) == set(
                model.model_fields
            ), name
    walr = flows["walr"]  # a public runner: one keyword per field, its bounds in the form
    form = walr.parameters.model_dump()["properties"]
    assert form["epsilon"]["exclusiveMinimum"] == 0 and "default" not in form["epsilon"]
    assert form["holdout_fraction"]["exclusiveMaximum"] == 1 and form["l2"]["default"] == 1e-3
    with pytest.raises(ValueError, match="clip_norm"):
        walr.fn({}, {}, epsilon=1.0, delta=1e-5, clip_norm=-1.0)


def _test_only(name: str) -> bool:
    """A name only a test would set: faults, small keys, releases without noise. Those are the
    test switches of ``core.test_switches``, read from the environment, never options."""
    return (
        name.startswith("inject_")
        or "test" in name
        or "noise_disabled" in name
        or "noiseless" in name
        or name in {"allow_insecure_key_size", "fail_at_round"}
    )


def _user_facing_flows() -> dict[str, Flow]:
    """Every flow a deployment form or a party process can start: each one defined in
    ``flows/`` (the party flows among them) and each deployment's entrypoint."""
    found: dict[str, Flow] = {}
    for path in sorted((ROOT / "flows").glob("*.py")):
        module = importlib.import_module(f"flows.{path.stem}")
        found.update(
            {v.name: v for v in vars(module).values() if isinstance(v, Flow)}  # imported too
        )
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    for deployment in deployments:
        file, name = deployment["entrypoint"].split(":")
        stage_flow = getattr(importlib.import_module(file[: -len(".py")].replace("/", ".")), name)
        found[stage_flow.name] = stage_flow
        assert not [k for k in deployment.get("parameters", {}) if _test_only(k)], deployment
    return found


def test_no_user_facing_flow_job_file_or_command_has_a_test_only_option() -> None:
    """Issue 25.8: the deployment form, job files and ``privreg party`` never offer a test's
    fault, small key or release without noise (each is a test switch in the environment)."""
    flows = _user_facing_flows()
    assert {"horizontal_lr", "horizontal_lr_party", "sparse_lda_party", "walr_party"} <= set(flows)
    offered = {
        f"{name}({parameter})"
        for name, stage_flow in flows.items()
        for parameter in inspect.signature(stage_flow.fn).parameters
        if _test_only(parameter)
    }
    models = [v for v in vars(schema).values() if isinstance(v, type) and issubclass(v, BaseModel)]
    assert set(STAGE_FLOWS) <= set(models)
    offered |= {f"{m.__name__}.{k}" for m in models for k in m.model_fields if _test_only(k)}
    commands = [build_parser()]
    while commands:  # every option of every (sub)command but the owner's consent to test runs
        parser = commands.pop()
        if parser.prog == "privreg policy":
            continue
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                commands.extend(action.choices.values())
            for option in action.option_strings:
                if _test_only(option.lstrip("-").replace("-", "_")):
                    offered.add(f"{parser.prog} {option}")
    assert offered == set()
