"""Flow ``pipeline_party``: one organisation's side of a whole job file, run at that organisation.

    main job   load own table ─▶ PSI ─▶ vertical LR ─▶ WALR      guest, host (+ the arbiter)
    sub-jobs, in the job file's order:
      label DP       load ─▶ PSI ─▶ label_dp_party               labels (guest), features (host)
      horizontal LR  load ─▶ horizontal_lr_party | _coordinator  hospitals, the coordinator
      sparse LDA     load ─▶ sparse_lda_party | _coordinator     hospitals, the coordinator

More: docs/federation.md (how the parties run a job, and why).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import get_client
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from prefect.states import Crashed

from core.job_files import read_job
from core.job_schema import KINDS, job_kind
from core.job_terms import differences, digest, job_terms, protocol_mismatch
from core.lifetime import alive
from core.preprocessing import PreprocessingSpec
from federation import watchers
from federation.channel import MessageConflictError, check_name
from federation.party_config import ENV_VAR, PartyConfig, active_config
from federation.standing_policy import epsilon_spent_since
from federation.status import (
    LIVE,
    RESTART_GRACE,
    Federation,
    PartyStatus,
    beside_status,
    describe_exit,
)
from federation.workspace import channel_for
from flows.align import psi_align_party
from flows.horizontal_lr import horizontal_lr_coordinator, horizontal_lr_party
from flows.label_dp import label_dp_party
from flows.scoring import score_vertical_party
from flows.sparse_lda import sparse_lda_coordinator, sparse_lda_party
from flows.sparse_lda import summary_line as sparse_lda_summary
from flows.vertical_party import vertical_lr_party
from flows.walr import walr_party
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.models import model_key
from storage.party_store import PartyStore
from storage.sources import sources_problems
from tasks.loading import load_table
from tasks.reporting import job_named
from tasks.scoring import promote_model
from tasks.secure_sum import COORDINATOR

ARBITER = "arbiter"  # the key holder's name in vertical_lr
HOSPITAL_JOBS = ("horizontal_lr", "sparse_lda")  # sub-jobs of hospitals and a coordinator
APPROVAL_TIMEOUT = 3600  # seconds a proposed job waits for a person's approval (manual policy)


class PipelineRefusalError(ValueError):
    """This party refuses the job file (names the party, the job and what it refuses)."""


@dataclass(frozen=True)
class StageResult:
    """One stage as this party ran it: its flow's own result holds only what it may see."""

    job: str
    stage: str
    job_id: str
    role: str
    seconds: float
    summary: str
    result: dict[str, Any] = field(repr=False)

    def line(self, party: str) -> str:
        return (
            f"{party} {self.job}/{self.stage} ({self.role}, {self.seconds:.1f} s): {self.summary}"
        )


@dataclass(frozen=True)
class PipelineResult:
    party: str
    job: str
    run: str | None
    stages: list[StageResult]


@dataclass(frozen=True)
class PartyJob:
    """A job file as one party reads it: its options, the roles' party names, its own tables.
    ``kind`` is "main" or the sub-job's name in the main job's ``subjobs``."""

    kind: str
    name: str
    spec: dict[str, Any]
    config: PartyConfig
    folder: Path
    run: str | None

    @property
    def party(self) -> str:
        return self.config.party

    def run_key(self) -> str:
        """The job run every party of this job names alike (its state is kept under it)."""
        return check_name(self.name + (f"-{self.run}" if self.run else ""), "job id")

    def droppable(self) -> tuple[str, ...]:
        """Parties whose failure the job's protocol survives as a dropout (its hospitals, while
        the threshold holds): their failure is not the job's. None where the threshold
        requires every hospital: one that fails or is cut off past the restart grace then
        fails the job at every party, named, as in a protocol without dropouts."""
        if self.kind not in HOSPITAL_JOBS:
            return ()
        hospitals = tuple(p for p in self.participants() if p != COORDINATOR)
        threshold = self.options(self.kind).threshold
        return () if threshold is not None and threshold >= len(hospitals) else hospitals

    def preprocessing(self, key: str | None = None) -> PreprocessingSpec:
        """The job's preprocessing (scaling, imputation), with entry ``key``'s own missing
        values and categories when given: what every party's flow is passed, as in one
        process."""
        spec = PreprocessingSpec.from_dict(self.spec.get("preprocessing"))
        if key is None:
            return spec
        return spec.with_party(self.spec["parties"][key].get("preprocessing"))

    @functools.cached_property
    def model(self) -> Any:
        """The job file as its validated model (core/job_schema.py), defaults filled: once."""
        return KINDS[self.kind].model_validate(self.spec)

    def options(self, stage: str) -> Any:
        """The stage's validated options."""
        return getattr(self.model, stage)

    def stages(self) -> tuple[str, ...]:
        """The stages whose message job ids this job uses (see :meth:`job_id`)."""
        return {"main": ("psi", "vertical", "walr"), "label_dp": ("psi", "label_dp")}.get(
            self.kind, (self.kind,)
        )

    def job_id(self, stage: str) -> str:
        """The id every party of this job derives alike for ``stage``."""
        return check_name(f"{self.name}-{stage}" + (f"-{self.run}" if self.run else ""), "job id")

    def parties(self) -> dict[str, str]:
        """Role (or key) in the job file ─▶ the party its table descriptor names."""
        return {key: _party_of(entry["table"]) for key, entry in self.spec["parties"].items()}

    def participants(self) -> set[str]:
        return participants(self.kind, self.spec)

    def own(self) -> dict[str, tuple[Path, TableRef, dict[str, float] | None]]:
        """This party's entries (source, table, initial budget), each path inside its own
        folder and each descriptor its own (``PartyConfig.own_table``), else refused."""
        mine = {}
        for key, entry in self.spec["parties"].items():
            if _party_of(entry["table"]) != self.party:
                continue
            table = dict(entry["table"])
            table["database"] = str(self.inside(table["database"], f"{key}'s database"))
            source = self.inside(entry["source"], f"{key}'s source")
            ref = TableRef.from_dict(self.config.own_table(table))
            mine[key] = (source, ref, entry.get("privacy_budget"))
        return mine

    def check_sources(self) -> None:
        """Refuse the job if one of this party's source files lacks a column its entry names,
        or its size breaks a rule that needs no alignment (core/job_checks.py), naming party,
        file and column: before PSI, not minutes into the job."""
        sources = {key: source for key, (source, _, _) in self.own().items()}
        if problems := sources_problems(self.model, sources):
            raise PipelineRefusalError(
                f"{self.party} refuses job {self.name}: " + "; ".join(problems)
            )

    def inside(self, value: str, what: str) -> Path:
        """``value`` read from this organisation's folder; refused if it leaves the folder
        (a local run's operator holds every party's files: nothing is refused there)."""
        path = (self.folder / value).resolve()
        if not self.config.local and not path.is_relative_to(self.folder):
            raise PipelineRefusalError(
                f"{self.party} refuses job {self.name}: {what} {value!r} is outside its own "
                f"folder {self.folder}"
            )
        return path


def _party_of(table: dict[str, Any]) -> str:
    return table.get("party") or Path(table["database"]).stem


def participants(kind: str, spec: dict[str, Any]) -> set[str]:
    """Every party of a job: its tables' owners, plus the arbiter or the coordinator."""
    names = {_party_of(entry["table"]) for entry in spec["parties"].values()}
    vertical = spec.get("vertical")
    if kind == "main" and vertical is not None and vertical.get("arbiter", True) is True:
        names.add(ARBITER)
    if kind in HOSPITAL_JOBS:
        names.add(COORDINATOR)
    return names


def organisations(job_file: str | Path, folder: Path) -> dict[str, set[str]]:
    """Every party of a job file and its sub-jobs (read from ``folder``), each with the source
    files it loads (paths as the job files write them): what each organisation must hold."""
    main = read_job(folder / job_file)
    jobs = [(job_kind(main), main)] + [
        (kind, read_job(folder / path)) for kind, path in main.get("subjobs", {}).items()
    ]
    holds: dict[str, set[str]] = {}
    for kind, spec in jobs:
        for party in participants(kind, spec):
            holds.setdefault(party, set())
        for entry in spec["parties"].values():
            holds[_party_of(entry["table"])].add(entry["source"])
    return holds


def _run_name() -> str:
    config, parameters = active_config(), flow_run.parameters or {}
    run = f" run {parameters['run']}" if parameters.get("run") else ""
    return f"{config.party if config else '?'}: pipeline {parameters.get('job_file')}{run}"


@flow(name="pipeline_party", flow_run_name=_run_name)
def pipeline_party(
    job_file: str = "jobs/demo.json", run: str = "", proposed_by: str = ""
) -> PipelineResult:
    """Run this organisation's stages of ``job_file`` (main job, then sub-jobs, in order; a
    sub-job file given on its own runs alone).

    Before any stage, the party refuses the job if a peer it would exchange messages with is
    not in its configuration, or if one of its entries points outside its own folder or at
    another party's table. Budgets are checked by each stage's flow before it computes.

    Args:
        job_file: The job file every organisation holds; this path and the relative paths
            in it are read from this organisation's folder, the folder of its party.toml.
        run: Suffix of the agreed job ids for a scheduled re-run ("" for the job itself).
        proposed_by: The peer whose proposal started this side ("" when started here); with
            ``approval = "manual"`` in the party's policy such a side waits for a person.
    """
    config, folder = _this_party()
    jobs = read_jobs(job_file, config, folder, run)
    main = jobs[0]
    results: list[StageResult] = []
    with federated(jobs) as sides:  # every failure from here on reaches every peer
        for job in jobs:  # refuse before anything is loaded or sent
            _check_peers(job)
            job.own()
        agree(jobs, sides)
        for job in jobs:
            check_policy(job)
            job.check_sources()
        if proposed_by and config.policy.approval == "manual":
            await_approval(jobs, sides, proposed_by)
        for job in jobs:
            side = sides.get(job.name)
            with job_named(job.name), _bound_to_terms(job, side):  # named, not tagged
                if side is not None:
                    side.set_state("running")
                results.extend(STAGES[job.kind](job))
                promote(job, main.name)
                if side is not None:
                    side.set_state("done")
    return PipelineResult(config.party, main.name, run or None, results)


# ---- the main job: PSI, vertical LR, WALR ------------------------------------------------------
def _main_stages(job: PartyJob) -> Iterator[StageResult]:
    parties = job.parties()
    guest, host = parties["guest"], parties["host"]
    vertical = job.options("vertical")
    own = yield from _load(job)
    role = next(iter(own), None)  # "guest" or "host"; None at the arbiter
    aligned, peer = None, host if role == "guest" else guest
    preprocessing = job.preprocessing().to_dict()
    if role is not None:
        aligned = yield from _align(job, role, own[role], peer)
    if vertical is not None and (role is not None or (vertical.arbiter and job.party == ARBITER)):
        yield from _stage(
            job, "vertical", role or "arbiter", vertical_lr_party, role or "arbiter",
            job.job_id("vertical"), guest, [host], vertical, own=aligned, arbiter=ARBITER,
            preprocessing=preprocessing,
        )  # fmt: skip
    if job.options("walr") is not None and role is not None:  # guest: labels, host: features
        side = "labels" if role == "guest" else "features"
        yield from _stage(
            job, "walr", side, walr_party, aligned, side, peer, job.job_id("walr"),
            job.options("walr"), preprocessing,
        )  # fmt: skip


def _align(
    job: PartyJob, role: str, ref: TableRef, peer: str
) -> Generator[StageResult, None, dict[str, Any]]:
    """The PSI stage of the guest or the host with its peer; returns the aligned table."""
    psi = yield from _stage(
        job, "psi", role, psi_align_party, ref.to_dict(), peer, job.job_id("psi"),
        job.options("psi"),
    )  # fmt: skip
    return psi["aligned"]


# ---- sub-jobs ----------------------------------------------------------------------------------
def _label_dp_stages(job: PartyJob) -> Iterator[StageResult]:
    """The guest holds the protected labels, the host the features (as in ``label_dp_job``)."""
    parties = job.parties()
    own = yield from _load(job)
    for role, ref in own.items():
        side = "labels" if role == "guest" else "features"
        peer = parties["host"] if role == "guest" else parties["guest"]
        aligned = yield from _align(job, role, ref, peer)
        yield from _stage(
            job, "label_dp", side, label_dp_party, aligned, side, peer,
            job.job_id("label_dp"), job.options("label_dp"), job.preprocessing().to_dict(),
        )  # fmt: skip


def _hospitals(job: PartyJob, party_flow: Any, coordinator_flow: Any) -> Iterator[StageResult]:
    """A sub-job of hospitals and a coordinator: each hospital runs its side on its own table,
    the coordinator (no table) its own; both take the job file's options whole."""
    hospitals = list(job.parties().values())
    options, preprocessing = job.options(job.kind), job.preprocessing().to_dict()
    own = yield from _load(job)
    for ref in own.values():
        yield from _stage(
            job, job.kind, "hospital", party_flow, ref.to_dict(), hospitals,
            job.job_id(job.kind), options, preprocessing,
        )  # fmt: skip
    if job.party == COORDINATOR:
        yield from _stage(
            job, job.kind, "coordinator", coordinator_flow, hospitals, job.job_id(job.kind),
            options, preprocessing,
        )  # fmt: skip


#: The models each kind of job trains: (model flow, stage, split into party shares).
MODELS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "main": (("vertical", "vertical", True), ("walr", "walr", False)),
    "label_dp": (("label_dp", "label_dp", False),),
    "horizontal_lr": (("horizontal", "horizontal_lr", False),),
    "sparse_lda": (("sparse_lda", "sparse_lda", False),),
    "score_vertical": (),
}


def promote(job: PartyJob, main_job: str) -> None:
    """What this party trained in ``job`` (a model, or its share of a split one) becomes the
    model the main job's scoring uses, in the party's own store."""
    for _, ref, _ in job.own().values():
        for flow_name, stage, split in MODELS[job.kind]:
            key = model_key(flow_name, job.job_id(stage), job.party if split else None)
            promote_model(ref, key, main_job)


def _score_vertical_stages(job: PartyJob) -> Iterator[StageResult]:
    """New rows of the guest and the host, scored with a promoted vertical model: each loads
    its table, then scores its share (the PSI of the new rows is the scoring side's own)."""
    parties = job.parties()
    own = yield from _load(job)
    for role, ref in own.items():
        yield from _stage(
            job, "score_vertical", role, score_vertical_party, ref.to_dict(), role,
            parties["guest"], [parties["host"]], job.job_id("score_vertical"),
            job.options("score_vertical"),
        )  # fmt: skip


STAGES: dict[str, Callable[[PartyJob], Iterator[StageResult]]] = {
    "main": _main_stages,
    "label_dp": _label_dp_stages,
    "horizontal_lr": functools.partial(
        _hospitals, party_flow=horizontal_lr_party, coordinator_flow=horizontal_lr_coordinator
    ),
    "sparse_lda": functools.partial(
        _hospitals, party_flow=sparse_lda_party, coordinator_flow=sparse_lda_coordinator
    ),
    "score_vertical": _score_vertical_stages,
}


# ---- one agreed job, one state across the federation -------------------------------------------
class TermsMismatchError(PipelineRefusalError):
    """A peer holds other terms for the job: refused before any data moves."""


@contextlib.contextmanager
def federated(jobs: list[PartyJob]) -> Iterator[dict[str, Federation]]:
    """A :class:`Federation` for each job this party takes part in, started at once (so a
    failure even in set-up reaches every peer of every job), ended with the block: done, or
    failed with the reason, which every peer hears within seconds."""
    sides: dict[str, Federation] = {}
    for job in jobs:
        if job.party in (parties := job.participants()):
            transport = channel_for(job.job_id("terms")).transport
            _mark_vanished_attempt_crashed(transport, job.run_key(), job.party)
            sides[job.name] = Federation(
                transport, job.run_key(), job.party, tuple(parties),
                restart_grace=float(job.spec.get("restart_grace", RESTART_GRACE)),
                log=get_run_logger(), show=_show_status, tolerated=job.droppable(),
            ).start("queued")  # fmt: skip
            beside_status(transport, job.run_key(), job.party, "flow_run").write_text(
                f"{flow_run.id} {os.getpid()}"
            )
    try:
        yield sides
    except BaseException as error:
        reason, state = describe_exit(error)
        for side in sides.values():
            side.fail(reason, state)
            _show_status(side)
        raise
    for side in sides.values():
        side.finish()
        _show_status(side)


def _mark_vanished_attempt_crashed(transport: Any, job: str, party: str) -> None:
    """This side's previous attempt at ``job`` whose process vanished (kill -9, machine down)
    left its Prefect run RUNNING: mark it Crashed, so the party's UI tells the truth."""
    data = transport.store().read_status(job, party)
    if data is None:
        return
    old = PartyStatus.from_bytes(data)
    where = beside_status(transport, job, party, "flow_run")
    if old.state not in LIVE or not where.exists():
        return  # ended cleanly (its state says so), or never started a run
    previous, _, pid = where.read_text().partition(" ")
    if pid.strip().isdigit() and alive(int(pid)):
        return  # its process is alive: another side of this party runs the job
    if previous and previous != str(flow_run.id):
        message = (
            f"the process running {party}'s side of job {job} vanished (last heartbeat "
            f"{time.strftime('%H:%M:%S', time.localtime(old.heartbeat))}); a new attempt took over"
        )
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(previous, Crashed(message=message), force=True)
        get_run_logger().warning("marked run %s Crashed: %s", previous, message)


def agree(jobs: list[PartyJob], sides: dict[str, Federation]) -> None:
    """Exchange every job's terms with its peers (all sends first, then the receives, so no
    two parties wait for each other) and refuse any peer whose terms differ, naming each
    differing option with both values. Nothing is loaded or sent before this."""
    mine, taking = {}, [(job, sides[job.name]) for job in jobs if job.name in sides]
    for job, side in taking:
        side.set_state("agreeing")
        mine[job.name] = terms = job_terms(job.kind, job.spec, job.run)
        endpoint = channel_for(job.job_id("terms")).endpoint(job.party)
        for peer in side.peers:
            try:
                endpoint.send(peer, "terms", terms)
            except MessageConflictError:
                raise TermsMismatchError(
                    f"{job.party} refuses job {job.name}: it agreed to other terms for this "
                    f"run before (its job file, or privreg's protocol version, changed since); "
                    f"start a new run (--run) instead"
                ) from None
    for job, side in taking:
        endpoint = channel_for(job.job_id("terms")).endpoint(job.party)
        for peer in side.peers:
            theirs = endpoint.receive(peer, "terms")
            if (mismatch := protocol_mismatch(mine[job.name], theirs)) is not None:
                raise TermsMismatchError(f"{job.party} refuses job {job.name}: {peer}: {mismatch}")
            found = differences(mine[job.name], theirs)
            if found:
                raise TermsMismatchError(
                    f"{job.party} refuses job {job.name}: the terms of {peer} differ: "
                    + "; ".join(d.describe(job.party, peer) for d in found)
                )
        side.digest = digest(mine[job.name])
        side.set_state("queued", f"terms agreed ({side.digest[:12]}); runs in the job's order")
        get_run_logger().info(
            "%s agreed job %s with %s (terms %s)", job.party, job.run_key(),
            ", ".join(side.peers), side.digest[:12],
        )  # fmt: skip


def _bound_to_terms(job: PartyJob, side: Federation | None) -> contextlib.AbstractContextManager:
    """Every message of the job's stages is bound to the agreed terms' digest: one sent under
    other terms (an organisation whose job file changed after agreeing, a stray earlier run) is
    refused by its receiver, naming the sender."""
    if side is None or not side.digest:
        return contextlib.nullcontext()
    return watchers.bound([job.job_id(stage) for stage in job.stages()], side.digest)


class PolicyRefusalError(PipelineRefusalError):
    """The party's standing policy refuses the job (names each rule)."""


class JobDeclinedError(PipelineRefusalError):
    """A person at the party declined the job."""


def check_policy(job: PartyJob) -> None:
    """Refuse the job if it breaks a rule of this party's standing policy (party.toml)."""
    if job.party not in job.participants():
        return
    broken = job.config.policy.violations(job.kind, job.spec, _released_tables(job))
    if broken:
        raise PolicyRefusalError(f"{job.party} refuses job {job.name}: " + "; ".join(broken))


def _released_tables(job: PartyJob) -> dict[str, float] | None:
    """Epsilon spent in the last 24 h on each table this party releases from in ``job``
    (the labels of the main job and label DP, a site's rows in sparse LDA); ``None`` if none."""
    spent = {
        ref.table: _spent_today(ref)
        for role, (_, ref, _) in job.own().items()
        if job.kind == "sparse_lda" or (job.kind in ("main", "label_dp") and role == "guest")
    }
    return spent or None


def _spent_today(ref: TableRef) -> float:
    """Epsilon spent on ``ref``'s table in the last day; a ledger that cannot be read refuses
    the job (fail closed: the charge checks the window again in its own transaction)."""
    if not Path(ref.database).exists():
        return 0.0  # no database yet: nothing was ever charged here
    try:
        return epsilon_spent_since(PrivacyLedger(PartyStore.of(ref)).spends(ref.table))
    except duckdb.CatalogException:  # no ledger or no such table yet: nothing was spent on it
        return 0.0
    except Exception as error:
        raise PolicyRefusalError(
            f"{ref.party} refuses the job: its ledger for table {ref.table!r} in {ref.database} "
            f"cannot be read ({type(error).__name__}: {error}), so its daily cap cannot be checked"
        ) from error


class Approval(RunInput):
    """What a person at this party answers to a proposed job."""

    approve: bool
    reason: str = ""


def await_approval(jobs: list[PartyJob], sides: dict[str, Federation], proposer: str) -> None:
    """Pause this run in the party's own Prefect until a person approves or declines (the UI's
    Resume form, or ``privreg job approve|decline``); peers see "approval" meanwhile."""
    terms = "\n".join(_terms_summary(job) for job in jobs if job.name in sides)
    since = time.strftime("%H:%M:%S")
    for side in sides.values():
        side.set_state("approval", f"awaiting a person's approval at {side.party} since {since}")
    description = f"**{proposer} proposes this job.** Approve to take part.\n\n{terms}"
    answer = pause_flow_run(
        wait_for_input=Approval.with_initial_data(description=description, approve=False),
        timeout=APPROVAL_TIMEOUT,
    )
    if not answer.approve:
        party = next(iter(sides.values())).party
        raise JobDeclinedError(
            f"{party} declined the job proposed by {proposer}: {answer.reason or 'no reason'}"
        )


def _terms_summary(job: PartyJob) -> str:
    """What a person approves: the parties and roles, what leaves this party, the epsilon."""
    roles = ", ".join(f"{role}: {party}" for role, party in job.parties().items())
    lines = [f"### job {job.run_key()} ({job.kind})", f"- parties: {roles}"]
    for group in ("walr", "label_dp", "sparse_lda"):
        options = job.spec.get(group) or {}
        if "epsilon" in options:
            lines.append(
                f"- {group}: epsilon {options['epsilon']}, delta {options.get('delta', 0)}"
            )
    mine = [f"{role} table {ref.table}" for role, (_, ref, _) in job.own().items()]
    lines.append(f"- from this party: {', '.join(mine) or 'no table (key holder/coordinator)'}")
    return "\n".join(lines)


def _show_status(side: Any) -> None:
    """The job's state at every party, as an artifact of this party's run (a new version at
    each stage, every few seconds while this party waits, and at the end). Written from the
    run's own threads only: Prefect's client is not to be shared with the federation's
    listening thread."""
    key = re.sub(r"[^a-z0-9-]+", "-", f"job-status-{side.job}".lower())[:100]
    create_table_artifact(side.table(), key=key, description=f"Job {side.job}: every party's state")


# ---- helpers -----------------------------------------------------------------------------------
def _this_party() -> tuple[PartyConfig, Path]:
    config = active_config()
    if config is None or config.folder is None:
        raise PipelineRefusalError(
            "pipeline_party runs as one party: start it with `privreg party pipeline --config "
            f"party.toml`, from `privreg party serve --flows` ({ENV_VAR} is not set), or "
            "locally with `privreg run`"
        )
    return config, config.folder


def read_jobs(job_file: str, config: PartyConfig, folder: Path, run: str) -> list[PartyJob]:
    """The job file as this party reads it: a main job and its sub-jobs in order, or a sub-job
    file alone (each path read from the party's folder)."""
    main = _read(folder / job_file, job_kind(read_job(folder / job_file)), config, folder, run)
    return [main] + [
        _read(main.inside(sub_file, f"sub-job {kind}"), kind, config, folder, run)
        for kind, sub_file in main.spec.get("subjobs", {}).items()
    ]


def _read(path: str | Path, kind: str, config: PartyConfig, folder: Path, run: str) -> PartyJob:
    if kind not in STAGES:
        raise PipelineRefusalError(
            f"{config.party} refuses sub-job {kind!r}: not one of {list(STAGES)[1:]}"
        )
    spec = read_job(path, kind)  # validated in full (core/job_schema.py)
    return PartyJob(kind, spec.get("job") or Path(path).stem, spec, config, folder, run or None)


def _check_peers(job: PartyJob) -> None:
    """Every party this one exchanges messages with in ``job`` must be in its configuration."""
    participants = job.participants()
    if job.party not in participants:
        return
    missing = sorted(p for p in participants - {job.party} if p not in job.config.peers)
    if missing:
        raise PipelineRefusalError(
            f"{job.party} refuses job {job.name}: its configuration has no address for {missing}"
        )


def _load(job: PartyJob) -> Generator[StageResult, None, dict[str, TableRef]]:
    """This party's own sources into its own databases (a budget only from the owner's own
    party.toml, never from the job file: see tasks.loading); returns its tables by role."""
    own = job.own()
    if not own:
        return {}
    started = time.perf_counter()
    rows = {
        key: load_table(str(source), ref, budget, job.preprocessing(key).to_dict())
        for key, (source, ref, budget) in own.items()
    }
    summary = ", ".join(f"{own[key][1].table} {n} rows" for key, n in rows.items())
    yield _finish(job, "load", "/".join(own), started, summary, {"rows": rows})
    return {key: ref for key, (_, ref, _) in own.items()}


def _stage(
    job: PartyJob, stage: str, role: str, party_flow: Any, *args: Any, **kwargs: Any
) -> Generator[StageResult, None, dict[str, Any]]:
    """Run one party flow; yields its stage result and returns the flow's own result.

    Between stages the job's state at every party is checked (a peer that failed while this
    party computed ends the job here before the next stage starts) and shown as an artifact.
    """
    watchers.check_peers()
    for side in watchers.active():
        _show_status(side)
    started = time.perf_counter()
    result = party_flow(*args, **kwargs)
    yield _finish(job, stage, role, started, summary_line(stage, role, result), result)
    return result


def _finish(
    job: PartyJob, stage: str, role: str, started: float, summary: str, result: dict[str, Any]
) -> StageResult:
    done = StageResult(
        job.name, stage, job.job_id(stage), role, time.perf_counter() - started, summary, result
    )
    get_run_logger().info("%s", done.line(job.party))
    return done


def summary_line(stage: str, role: str, r: dict[str, Any]) -> str:
    """One short line per stage: sizes, rounds, metrics and budgets (no value of any row)."""
    metrics = ", ".join(
        f"{k} {v:.4f}" for k, v in r.get("metrics", {}).items() if isinstance(v, int | float)
    )
    tail = f", {metrics}" if metrics else ""
    if stage == "psi":
        return f"{r['intersection_size']} shared rows of {r['set_sizes'][0]} / {r['set_sizes'][1]}"
    if stage == "score_vertical" and role == "guest":
        auc = f", AUC {r['auc']:.4f}" if r.get("auc") is not None else ""
        return f"{r['rows']} rows scored into {r['scores_table']} with {r['model_key']}{auc}"
    if stage == "score_vertical":
        return f"score shares of {r['rows']} rows sent (model job {r['model_job_id']})"
    if stage == "vertical":
        return f"{r['rounds_run']} rounds run, final round {r['final_round']}{tail}"
    if stage in ("walr", "label_dp") and role == "labels":
        budget, reused = r["budget"], r.get("reused_release", r.get("reused"))
        return (
            f"release {'reused, nothing charged' if reused else 'made and charged'}, privacy "
            f"spent {budget['epsilon_spent']:g} of {budget['epsilon_total']:g}{tail}"
        )
    if stage in ("walr", "label_dp"):
        return f"model trained on the release, {r['rows']} rows{tail}"
    if stage == "sparse_lda" and role == "coordinator":
        return sparse_lda_summary(r)
    if stage == "sparse_lda":
        kept = f"{len(r['support'])} of {len(r['features'])} features kept"
        budget = (r.get("release") or {}).get("budget")
        if budget is None:  # nothing charged (a release without noise, tests only)
            return kept
        return f"{kept}, privacy spent {budget['epsilon_spent']:g} of {budget['epsilon_total']:g}"
    if "rounds_completed" in r:
        loss = f", loss {r['history'][-1]['loss']:.4f}" if r.get("history") else ""
        return f"{r['rounds_completed']} rounds{loss}"
    return ", ".join(f"{k} {v}" for k, v in r.items() if isinstance(v, int | float | str))
