"""What the Prefect UI shows: run names, per-round tables, progress, one summary per run, models.

More: docs/reporting.md (what a run publishes, and why).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext, TagsContext
from prefect.runtime import deployment as runtime_deployment
from prefect.runtime import flow_run as runtime_flow_run

from core.model_format import ModelRecord
from core.outcomes import RISE_SDS, noise_margin
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks.policy import PARTY_STEP

#: Short names of the flows, used in run names and artifact keys; a side of a protocol
#: (``<flow>_party``, ``<flow>_coordinator``) is named as its protocol, whichever way it runs.
FLOW_SHORT = {
    "psi_align": "psi",
    "vertical_lr": "vertical",
    "label_dp_regression": "label-dp",
    "horizontal_lr": "horizontal",
    "sparse_lda": "sparse-lda",
}
#: Flow parameters that hold table descriptors, in the order that names a run.
_TABLE_PARAMETERS = (
    "own",
    "party_a",
    "guest",
    "features",
    "labels",
    "parties",
    "table",
    "party_b",
    "hosts",
)
_JOB_TAG = "job:"
_JOB = contextvars.ContextVar[str | None]("privreg_job", default=None)


@contextlib.contextmanager
def job_named(name: str) -> Iterator[None]:
    """Runs started inside (a job's sides and stages) report under job ``name``: what a
    ``job:<name>`` tag said, without tagging their task runs (a tagged step asks the server
    for its tags' concurrency slots first)."""
    token = _JOB.set(name)
    try:
        yield
    finally:
        _JOB.reset(token)


_DERIVED_ID = re.compile(r"^([a-z-]+-)?([0-9a-f]{16,})$")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def _tables(parameters: dict[str, Any]) -> list[str]:
    tables = []
    for name in _TABLE_PARAMETERS:
        value = parameters.get(name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and "table" in item:
                tables.append(f"{item.get('party') or Path(item['database']).stem}.{item['table']}")
    return tables


def _job_in_file(path: str) -> str:
    """The ``job`` a job file names (its file name when it names none or cannot be read)."""
    try:
        named = json.loads(Path(path).read_text()).get("job")
    except (OSError, ValueError, AttributeError):
        named = None
    return str(named or Path(path).stem)


def job_name() -> str:
    """The readable job a run belongs to: its job file's, else the job it runs in
    (:func:`job_named`), its ``job:<name>`` tag, its deployment's name, (a party's flow) its
    agreed job id, or its first table's name (the order: docs/reporting.md, names)."""
    parameters = runtime_flow_run.parameters or {}
    if parameters.get("job_file"):
        return _slug(_job_in_file(str(parameters["job_file"])))
    if (named := _JOB.get()) is not None:
        return _slug(named)
    for tag in [*TagsContext.get().current_tags, *(runtime_flow_run.tags or [])]:
        if tag.startswith(_JOB_TAG):
            return _slug(tag.removeprefix(_JOB_TAG))
    deployment = _deployment_name()
    if deployment:
        return _slug(deployment)
    side = (runtime_flow_run.flow_name or "").endswith(("_party", "_coordinator"))
    if side and parameters.get("job_id"):  # one party's side: the id every party agreed on
        return _slug(str(parameters["job_id"]))
    tables = _tables(parameters)
    return _slug(tables[0].split(".", 1)[1]) if tables else "adhoc"


_DEPLOYMENT_NAMES: dict[str, str | None] = {}  # by flow run id: a run's deployment never changes


def _deployment_name() -> str | None:
    """The name of the deployment the current flow run came from, None outside one.

    ``prefect.runtime.deployment.name`` fetches the flow run from the API through a new client
    on every call when the run has no deployment (it looks for the deployment id on the run
    context, not on its flow run); a job's reports call this a dozen times. The run context's
    flow run already says whether there is a deployment, and a name read once per run stands."""
    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    if run is None:  # no run context here: ask the runtime as before
        return runtime_deployment.name
    key = str(run.id)
    if key not in _DEPLOYMENT_NAMES:
        _DEPLOYMENT_NAMES[key] = runtime_deployment.name if run.deployment_id else None
    return _DEPLOYMENT_NAMES[key]


def short_flow(flow: str) -> str:
    """``flow``'s short name (:data:`FLOW_SHORT`), its sides' alike."""
    protocol = re.sub(r"_(party|coordinator)$", "", flow)
    return FLOW_SHORT.get(protocol, _slug(protocol))


def flow_short() -> str:
    return short_flow(runtime_flow_run.flow_name or "flow")


def run_namer(flow: str) -> Callable[[], str]:
    """``flow_run_name`` for a flow: ``<job> <flow>: <party.table>, ...`` (job and flow first)."""

    def name() -> str:
        job, short = job_name(), short_flow(flow)
        head = job if job == short or job.endswith(f"-{short}") else f"{job} {short}"
        tables = _tables(runtime_flow_run.parameters or {})
        return f"{head}: {', '.join(tables)}" if tables else head

    return name


_PART_SHORT = {"vertical-lr": "vertical", "horizontal-lr": "horizontal"}


def short_id(part: str) -> str:
    """A derived job id (``vertical-<16 hex>``) by its first 8 hex digits; others as given."""
    derived = _DERIVED_ID.match(part.lower())
    return derived.group(2)[:8] if derived else part


def artifact_key(*parts: str) -> str:
    """A readable key, ``<job>-<flow>-<job id>-<what>``: a derived job id by its first 8 hex
    digits, and a job named after its flow (the deployment ``demo-vertical``) does not repeat
    the flow."""
    job = job_name()
    kept = [_slug(short_id(str(p))) for p in parts]
    kept = [k for k in kept if k != job]  # a party flow's job is its agreed job id
    if kept:
        kept[0] = _PART_SHORT.get(kept[0], kept[0])
        if job == kept[0] or job.endswith(f"-{kept[0]}"):
            kept = kept[1:]
    key = re.sub(r"-+", "-", "-".join([job, *kept])).strip("-")
    return key[:100]


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and not isinstance(value, (list, dict)):
        value = value.item()
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")  # six significant digits: a delta of 1e-7 stays 1e-07
    return value


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    create_table_artifact(
        key=key,
        table=[{k: _plain(v) for k, v in row.items()} for row in rows],
        description=description,
    )


def publish_markdown(key: str, markdown: str, description: str) -> None:
    create_markdown_artifact(key=key, markdown=markdown, description=description)


# ---------------------------------------------------------------------------------------------
# Models


def model_table(record: dict[str, Any]) -> tuple[list[dict[str, Any]], float | None]:
    """(feature, coefficient) rows and the intercept of a stored model record."""
    model = ModelRecord.from_dict(record)
    rows = [
        {"feature": f, "coefficient": c}
        for f, c in zip(model.features, model.coefficients, strict=True)
    ]
    return rows, model.intercept


def provenance(*refs: TableRef) -> dict[str, Any]:
    """What a model record says about where it came from: the readable job of this run and the
    salted digests of the tables it was trained on (they reveal only "changed or not")."""
    from tasks.loading import fingerprint

    return {
        "job": job_name(),
        "fingerprints": {f"{ref.party}.{ref.table}": fingerprint(ref) for ref in refs},
    }


@task(name="describe-model", task_run_name="{party}: describe model {model_key}", **PARTY_STEP)
def describe_model(party: str, database: str, model_key: str) -> dict[str, Any]:
    """A party's public description of one of its saved models (its own store only)."""
    record = ArtifactStore(PartyStore(database)).get(model_key)
    if record is None:
        raise KeyError(f"party {party}: no model {model_key!r} in {Path(database).name}")
    model = ModelRecord.from_dict(record)
    rows, intercept = model_table(record)
    return {
        "party": party,
        "key": model_key,
        "database": str(Path(database).resolve()),
        "coefficients": rows,
        "intercept": intercept,
        "job": f"{model.job} ({model.job_id})" if model.job else model.job_id,
        "trained_on": ", ".join(model.fingerprints) or "-",
        "rows": ", ".join(f"{n:,} {what}" for what, n in model.rows.items()) or "-",
        "fingerprint": ", ".join(d[:16] for d in model.fingerprints.values()) or "-",
        "saved_at": model.created,
    }


def model_markdown(description: dict[str, Any]) -> str:
    items = [
        ("party", description["party"]),
        ("model key", f"`{description['key']}`"),
        ("stored in", f"`{description['database']}`"),
        ("job", description["job"]),
        ("trained on", description["trained_on"]),
        ("rows", description["rows"]),
        ("fingerprint", description["fingerprint"]),
        ("saved at", description["saved_at"]),
        ("intercept", "-" if description["intercept"] is None else description["intercept"]),
    ]
    return "\n\n".join(
        [
            f"# Model `{description['key']}`",
            markdown_table([{"item": k, "value": v} for k, v in items]),
            "## Coefficients",
            markdown_table(description["coefficients"]),
            "Open it with `privreg models show --database "
            f"{description['database']} --key {description['key']}`.",
        ]
    )


def publish_model_link(key: str, database: str | Path, model_key: str, party: str = "") -> None:
    """The model as a readable artifact (coefficients by feature, intercept, where it lives)."""
    who = party or Path(database).stem
    description = describe_model(who, str(database), model_key)
    publish_markdown(key, model_markdown(description), f"model {model_key} of {who}")


# ---------------------------------------------------------------------------------------------
# Progress and round history


PROGRESS_EVERY = 1.0
"""Seconds between two updates of a progress artifact (and its log line) before the end."""


class Progress:
    """A progress artifact for a flow's rounds (0-100%), updated at most every
    :data:`PROGRESS_EVERY` seconds and at the end (why: docs/reporting.md)."""

    def __init__(self, total: int, description: str) -> None:
        self.total = max(total, 1)
        self.id = create_progress_artifact(progress=0.0, description=description)
        self._shown = -math.inf

    def update(self, done: int) -> None:
        now = time.monotonic()
        if done < self.total and now - self._shown < PROGRESS_EVERY:
            return
        self._shown = now
        if self.id is not None:
            update_progress_artifact(self.id, progress=min(100.0, 100.0 * done / self.total))
        # a count of rounds done, not a round number (rounds are numbered from 0)
        get_run_logger().info("progress: %d of %d rounds done", done, self.total)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of ``rows`` (the first row's keys are the header). A cell's ``|`` is
    escaped and its line breaks become ``<br>``: either would otherwise end the cell (or the
    table) early and cut the rest of the text off."""
    if not rows:
        return "(none)"
    header = list(rows[0])
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(row.get(h)) for h in header) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    text = "" if value is None else str(_plain(value))
    return text.replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")


#: A rounds table's column of the DP noise each round's loss carries (its standard deviation).
LOSS_NOISE = "loss noise sd"


def loss_noise_column(entry: dict[str, Any]) -> dict[str, float]:
    """A round's DP loss noise (``loss_sd`` in a horizontal round's entry) as its rounds-table
    column; nothing without DP."""
    return {LOSS_NOISE: entry["loss_sd"]} if "loss_sd" in entry else {}


def round_warnings(history: list[dict[str, Any]], loss: str = "loss") -> list[str]:
    """What a reader should look at: a loss that rose at the end (by more than its DP noise,
    column :data:`LOSS_NOISE`, explains), a diverging gradient."""
    warnings = []
    losses = [(r["round"], r[loss]) for r in history if r.get(loss) is not None]
    noise = noise_margin(history[-1].get(LOSS_NOISE) or 0.0, RISE_SDS) if history else 0.0
    if len(losses) >= 2 and losses[-1][1] > losses[-2][1] + noise:
        warnings.append(
            f"loss rose in the last round ({losses[-2][1]:.6g} in round {losses[-2][0]} -> "
            f"{losses[-1][1]:.6g} in round {losses[-1][0]})"
        )
    if any(not math.isfinite(v) for _, v in losses):
        warnings.append("the loss is not finite")
    norms = [r["gradient_norm"] for r in history if r.get("gradient_norm") is not None]
    if norms and (
        not all(math.isfinite(n) for n in norms) or norms[-1] > 10 * max(norms[0], 1e-12)
    ):
        warnings.append(
            f"the gradient diverges (norm {norms[0]:.4g} in the first round, "
            f"{norms[-1]:.4g} in the last)"
        )
    return warnings


# ---------------------------------------------------------------------------------------------
# One summary per run


@dataclass(frozen=True)
class Quality:
    """One quality figure of the model next to a plain baseline on the same rows."""

    metric: str
    model: float | None
    baseline: float | None
    higher_is_better: bool
    rows: str = "held-out rows"

    def below_baseline(self) -> bool:
        if self.model is None or self.baseline is None:
            return False
        return self.model < self.baseline if self.higher_is_better else self.model > self.baseline


@dataclass(frozen=True)
class BudgetLine:
    """Privacy spent and left on one protected table (its owner's ledger): the epsilon of
    all its releases composed, at the owner's delta (a target, not used up)."""

    party: str
    table: str
    epsilon_spent: float
    epsilon_left: float
    delta: float

    @classmethod
    def from_status(cls, party: str, status: dict[str, Any]) -> BudgetLine:
        return cls(
            party,
            str(status["protected_table"]),
            float(status["epsilon_spent"]),
            float(status["epsilon_left"]),
            float(status.get("delta_total", 0.0)),
        )


@dataclass
class RunSummary:
    """Everything a reader of one flow run needs, for the artifact and the log alike."""

    job_id: str
    parties: dict[str, int]  # rows each party used
    quality: list[Quality] = field(default_factory=list)
    budgets: list[BudgetLine] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    rounds_table: list[dict[str, Any]] = field(default_factory=list)
    details: list[tuple[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float | None = None

    def figures(self) -> dict[str, Any]:
        """The summary as plain values (what the flow returns and the tests compare)."""
        return {
            "job": job_name(),
            "flow": runtime_flow_run.flow_name,
            "job_id": self.job_id,
            "parties": dict(self.parties),
            "quality": [q.__dict__ for q in self.quality],
            "budgets": [b.__dict__ for b in self.budgets],
            "bytes_sent": dict(self.bytes_sent),
            "rounds": self.rounds,
            "seconds": self.seconds,
            "warnings": list(self.warnings),
        }


def bytes_sent(job_ids: Iterable[str], workspace: str | None) -> dict[str, int]:
    """Bytes each party sent in these jobs (every run of them), from the channel's log."""
    from federation.workspace import channel_for

    totals: dict[str, int] = {}
    for job_id in job_ids:
        for party, counts in channel_for(job_id, workspace).bytes_by_party().items():
            totals[party] = totals.get(party, 0) + int(counts["sent"])
    return totals


def human_bytes(count: int) -> str:
    """A byte count a person reads at a glance: B under 1 KiB, else KiB, MiB or GiB."""
    if count < 1024:
        return f"{count} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            return f"{count:,.1f} {unit}"
    raise AssertionError("unreachable")


def kib(count: int) -> float:
    """Bytes as KiB, for a table column whose header carries the unit."""
    return round(count / 1024, 1)


#: Each quality figure in plain words: a short name for log lines and what it says, for a
#: reader without the papers (the metric's own name follows in brackets).
PLAIN_METRICS = {
    "AUC": ("ranking", "how often a positive row scores above a negative one (0.5: chance)"),
    "log-loss": ("probability error", "how far the predicted probabilities are from the labels"),
    "MSE": ("squared error", "the average squared gap between prediction and true value"),
    "misclassification": ("wrong class", "the share of rows put in the wrong class"),
}


def plain_metric(metric: str) -> tuple[str, str]:
    """``metric`` (which may name a party or say pooled) as (a short name, what it says)."""
    for term, words in PLAIN_METRICS.items():
        if term in metric:
            return words
    return metric, ""


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _stage_lines(summary: RunSummary, job: str, flow: str) -> list[str]:
    lines = [
        f"job {job} ({summary.job_id}), flow {flow}: parties "
        + ", ".join(f"{p} {n:,} rows" for p, n in summary.parties.items())
    ]
    if summary.quality:
        lines.append(
            "quality: "
            + "; ".join(
                f"{plain_metric(q.metric)[0]} ({q.metric} {_number(q.model)}, baseline "
                f"{_number(q.baseline)}, {q.rows})"
                for q in summary.quality
            )
        )
    for b in summary.budgets:
        lines.append(
            f"privacy of {b.party}.{b.table}: used so far (epsilon spent {b.epsilon_spent:g}), "
            f"still to spend (epsilon left {b.epsilon_left:g}), chance the guarantee fails "
            f"(the owner's delta {b.delta:g})"
        )
    if summary.bytes_sent:
        lines.append(
            "traffic: "
            + ", ".join(f"{p} sent {human_bytes(n)}" for p, n in summary.bytes_sent.items())
        )
    lines.append(f"rounds {summary.rounds}, wall time {summary.seconds or 0.0:.1f} s")
    return lines


def summary_markdown(summary: RunSummary, job: str, flow: str) -> str:
    parts = [
        f"# {job}: {flow}",
        markdown_table(
            [
                {"item": "job", "value": job},
                {"item": "job id", "value": summary.job_id},
                {"item": "flow", "value": flow},
                {"item": "rounds", "value": summary.rounds},
                {"item": "wall time (s)", "value": f"{summary.seconds or 0.0:.1f}"},
                *({"item": k, "value": v} for k, v in summary.details),
            ]
        ),
        "## Parties",
        markdown_table(
            [
                {
                    "party": p,
                    "rows used": n,
                    "bytes sent": human_bytes(summary.bytes_sent.get(p, 0)),
                }
                for p in dict.fromkeys([*summary.parties, *summary.bytes_sent])
                for n in [summary.parties.get(p, "-")]
            ]
        ),
    ]
    if summary.quality:
        parts += [
            "## Quality",  # the table right under it (tests/helpers.py reads it back)
            markdown_table(
                [
                    {
                        "metric": q.metric,
                        "model": q.model,
                        "baseline": q.baseline,
                        "rows": q.rows,
                        "better is": "higher" if q.higher_is_better else "lower",
                        "what it says": plain_metric(q.metric)[1],
                    }
                    for q in summary.quality
                ]
            ),
        ]
    if summary.budgets:
        parts += [
            "## Privacy budget",
            "How much the released figures may reveal about any one row of a protected table "
            "(epsilon: lower is more private). Its owner sets a total; every release spends "
            "from it, and nothing is released once it is spent.",
            markdown_table(
                [
                    {
                        "party": b.party,
                        "protected table": b.table,
                        "privacy used so far (epsilon spent)": b.epsilon_spent,
                        "privacy still to spend (epsilon left)": b.epsilon_left,
                        "chance the guarantee fails (at the owner's delta)": b.delta,
                    }
                    for b in summary.budgets
                ]
            ),
        ]
    if summary.rounds_table:
        parts += ["## Rounds (every run of the job)", markdown_table(summary.rounds_table)]
    if summary.warnings:
        parts += ["## Warnings", "\n".join(f"- **WARNING** {w}" for w in summary.warnings)]
    return "\n\n".join(parts)


#: Figures of the summaries published in this process, by job id: a parent flow (the pipeline)
#: gathers its sub-flows' quality and budgets from here instead of recomputing them.
PUBLISHED: dict[str, dict[str, Any]] = {}


def publish_summary(summary: RunSummary) -> dict[str, Any]:
    """The run's one summary: a markdown artifact keyed ``<job>-<flow>-summary`` and the same
    figures as log lines; quality under the baseline and round warnings are WARNINGs."""
    context = FlowRunContext.get()
    if summary.seconds is None and context is not None:
        started = context.start_time.timestamp()
        summary.seconds = max(0.0, time.time() - started)
    for q in summary.quality:
        if q.below_baseline():
            summary.warnings.append(
                f"{q.metric} {_number(q.model)} is worse than the baseline "
                f"{_number(q.baseline)} ({q.rows})"
            )
    summary.warnings.extend(round_warnings(summary.rounds_table))
    job, flow = job_name(), flow_short()
    logger = get_run_logger()
    for line in _stage_lines(summary, job, flow):
        logger.info(line)
    for warning in summary.warnings:
        logger.warning(warning)
    key = artifact_key(flow, summary.job_id, "summary")
    publish_markdown(key, summary_markdown(summary, job, flow), f"{flow} summary of job {job}")
    PUBLISHED[summary.job_id] = {"key": key, **summary.figures()}
    return PUBLISHED[summary.job_id]
