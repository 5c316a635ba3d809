"""Whole jobs between organisations in their own namespaces, with links cut and endpoints
restarted mid-job: the shared machinery of ``bench_partitions.py`` and its test.

Each organisation runs its real commands in its namespace (``privreg party serve``, then
``privreg party pipeline --job-file ... --run RUN``), reporting to one Prefect API forwarded
into every namespace. A run's outcome per party is its exit status and, when it failed, the
reason its log gives. Its *model* is read from the party's own store; its *messages* are the
keys of every message each party received, with the SHA-256 of the bytes it holds and of the
bytes the sender kept: a run that lost, duplicated or changed a message shows it there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import wan
from core.job_files import read_job
from demo.orgs import Org
from demo.parties import ROOT, owner_budgets_toml
from federation import certs, identity
from federation.party_config import PartyConfig
from flows.pipeline_party import organisations
from storage import codec
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore

MAIN = "jobs/demo.json"
HORIZONTAL = "jobs/horizontal_demo.json"
MAIN_PARTIES = ["clinic", "lab", "arbiter"]
HOSPITALS = ["hospital_a", "hospital_b", "hospital_c", "coordinator"]


def small_jobs(source: Path, restart_grace: float, horizontal_rounds: int = 20) -> None:
    """The demo's main job (PSI, one vertical epoch at 1024-bit keys, no WALR or sub-jobs)
    and its horizontal job, under ``source/jobs``, each with ``restart_grace``. No rows are
    held out: the held-out rows are drawn by the job id, which names the run, and runs of
    other names must train on the same rows to be compared."""
    (source / "jobs").mkdir(parents=True, exist_ok=True)
    main = read_job(ROOT / MAIN)
    main.pop("subjobs")
    main.pop("walr")
    main["vertical"].update(epochs=1, key_size=1024, holdout_fraction=0.0)
    horizontal = read_job(ROOT / HORIZONTAL)
    horizontal["horizontal_lr"].update(rounds=horizontal_rounds, holdout_fraction=0.0)
    for path, job in ((MAIN, main), (HORIZONTAL, horizontal)):
        (source / path).write_text(json.dumps({**job, "restart_grace": restart_grace}))
    if not (source / "demo").exists():
        (source / "demo").symlink_to(ROOT / "demo")


def own_threshold() -> int:
    """The horizontal demo job's own secure-aggregation threshold (fewest hospitals a round
    accepts)."""
    return int(read_job(ROOT / HORIZONTAL)["horizontal_lr"]["threshold"])


def prepare(root: Path, net: wan.Wan, source: Path, receive_timeout: float) -> dict[str, Org]:
    """Each party's folder on ``net`` (certificate, ``party.toml`` naming its peers' relay
    ports) with the job files and its own source files copied in."""
    orgs = wan.make_orgs(root, net, receive_timeout)
    holds: dict[str, set[str]] = {}
    for job_file in (MAIN, HORIZONTAL):
        for party, paths in organisations(job_file, source).items():
            holds.setdefault(party, set()).update(paths)
    budgets = owner_budgets_toml([source / MAIN, source / HORIZONTAL])
    for party, org in orgs.items():
        for path in [MAIN, HORIZONTAL, *holds.get(party, ())]:
            (org.folder / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / path, org.folder / path)
        with org.config.open("a") as config:
            config.write(budgets.get(party, ""))
    return orgs


@dataclass
class Outcome:
    """One party's end of a run: exit status, the reason its log gives, its result."""

    party: str
    code: int
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    exited: float = 0.0  # seconds from its run's start

    @property
    def state(self) -> str:
        return "done" if self.code == 0 else "FAILED"

    def __str__(self) -> str:
        return f"{self.party} {self.state} ({self.exited:.0f} s)"


@dataclass
class Run:
    """Every party's pipeline process of one run."""

    net: wan.Wan
    orgs: dict[str, Org]
    job_file: str
    run: str
    extra: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def start(self, parties: list[str]) -> Run:
        for party in parties:
            org = self.orgs[party]
            with self.log(party).open("a") as log:
                args = ["--job-file", self.job_file, "--run", self.run]
                self.processes[party] = wan.start(
                    self.net, org, "pipeline", args, self.extra, stderr=log
                )
        return self

    def log(self, party: str) -> Path:
        return self.orgs[party].folder / f"{self.run}.log"

    def finish(self, timeout: float) -> dict[str, Outcome]:
        """Each party's outcome once all have ended (killed past ``timeout``), with the
        seconds from the run's start to its exit."""
        deadline, exited = time.monotonic() + timeout, {}
        while len(exited) < len(self.processes) and time.monotonic() < deadline:
            for party, process in self.processes.items():
                if party not in exited and process.poll() is not None:
                    exited[party] = time.monotonic() - self.started
            time.sleep(0.1)
        outcomes = {}
        for party, process in self.processes.items():
            if process.poll() is None:
                process.kill()
            out, _ = process.communicate()
            outcome = outcome_of(party, process.returncode, out, self.log(party))
            outcome.exited = exited.get(party, timeout)
            outcomes[party] = outcome
        return outcomes


ERROR_LINE = "privreg: error: "  # how the command reports the error it ended with


def outcome_of(party: str, code: int, out: str, log: Path) -> Outcome:
    """A party's result line when it finished, else the error its command ended with (the
    last error line of its log if it printed none)."""
    if code == 0:
        return Outcome(party, code, result=json.loads(out.strip().splitlines()[-1]))
    lines = log.read_text().splitlines()
    ended = [line.split(ERROR_LINE, 1)[1] for line in lines if line.startswith(ERROR_LINE)]
    others = [line for line in lines if "Error" in line or "party " in line]
    reason = (ended or others or [f"exit {code}"])[-1]
    return Outcome(party, code, reason=reason.strip())


def job_id(job_file: str, run: str, stage: str) -> str:
    """The agreed job id of a stage of ``run`` (``<job>-<stage>-<run>``)."""
    return f"{read_job(ROOT / job_file)['job']}-{stage}-{run}"


def received(orgs: dict[str, Org], run_ids: list[str]) -> dict[str, str]:
    """Every message the parties received in the stages ``run_ids`` (each noted once in the
    receiver's ``received/`` folder): its key and the SHA-256 of the copy the receiver holds."""
    found = {}
    for org in orgs.values():
        for run in run_ids:
            notes = org.messages / run / "received"
            for note in sorted(p for p in notes.rglob("*") if p.is_file()):
                rest = note.relative_to(notes)
                copy = org.messages / run / "messages" / rest
                digest = hashlib.sha256(copy.read_bytes()).hexdigest() if copy.is_file() else ""
                found[f"{run}/{rest}"] = digest
    return found


def sent_matches(orgs: dict[str, Org], run_ids: list[str]) -> list[str]:
    """The received messages whose copy is missing or differs from the sender's kept copy
    (none, if the channel delivered each as sent)."""
    differ = []
    for key, digest in received(orgs, run_ids).items():
        run, rest = key.split("/", 1)
        sender = rest.split("/")[-1].split("__")[0]
        kept = orgs[sender].messages / run / "messages" / rest
        if not digest or not kept.is_file():
            differ.append(f"{key}: a copy is missing")
        elif hashlib.sha256(kept.read_bytes()).hexdigest() != digest:
            differ.append(f"{key}: the receiver's bytes differ from the sender's")
    return differ


def signed_by(orgs: dict[str, Org], run_ids: list[str], fingerprints: set[str]) -> int:
    """How many received messages of ``run_ids`` their senders signed with one of the
    certificates ``fingerprints`` (the proof each receiver noted holds the sender's)."""
    count = 0
    for org in orgs.values():
        for run in run_ids:
            for note in (p for p in (org.messages / run / "received").rglob("*") if p.is_file()):
                lines = note.read_text().split("\n")
                if len(lines) < 2 or not lines[1]:
                    continue
                cert = bytes(codec.loads(bytes.fromhex(lines[1]))["cert"])
                count += identity.presented(cert).fingerprint in fingerprints
    return count


def stored(orgs: dict[str, Org], job_file: str, run: str, stage: str) -> dict[str, Any]:
    """Every artifact of a stage's job id in the stores of the parties holding a table: its
    models (``models/...``) and its round checkpoints (``.../round/<n>``)."""
    found = {}
    ident = job_id(job_file, run, stage)
    for entry in read_job(ROOT / job_file)["parties"].values():
        ref = TableRef.from_dict(entry["table"])
        database = str(orgs[ref.party].folder / ref.database)
        store = ArtifactStore(
            PartyStore.of(TableRef.from_dict({**entry["table"], "database": database}))
        )
        for key, *_ in store.list():
            if f"/{ident}/" in f"{key}/":
                found[f"{ref.party}:{key}"] = store.get(key)
    return found


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> float:
    """Poll ``condition`` until true; the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > seconds:
            raise TimeoutError(f"{what}: not after {seconds:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - started


# ---- the organisations of a module or benchmark ----------------------------------------------
@dataclass(frozen=True)
class Stage:
    """A job and the moment of it a case interrupts: once ``watch`` has received ``after``
    messages of ``stage``, ``victim``'s link is cut or its endpoint restarted."""

    name: str
    job_file: str
    parties: list[str]
    stage: str  # the stage whose messages are counted
    model_stage: str  # the stage whose model is compared
    watch: str
    victim: str
    after: int


PSI = Stage("PSI", MAIN, MAIN_PARTIES, "psi", "vertical", "clinic", "lab", 1)
# the clinic's first three vertical messages are the set-up (the lab's features and row order,
# the arbiter's key): a fourth is the round's
VERTICAL = Stage("vertical LR", MAIN, MAIN_PARTIES, "vertical", "vertical", "clinic", "lab", 4)
HORIZONTAL_ROUND = Stage(
    "horizontal LR", HORIZONTAL, HOSPITALS, "horizontal_lr", "horizontal_lr", "coordinator",
    "hospital_a", 30,
)  # fmt: skip


class Federation:
    """Every organisation of the main and horizontal jobs on one :class:`wan.Wan`, each
    serving its endpoint, reporting to the Prefect API at ``api_port``."""

    def __init__(self, root: Path, net: wan.Wan, api_port: int, extra: dict[str, str]) -> None:
        self.root, self.net = root, net
        self.source = root / "source"
        self.source.mkdir(parents=True, exist_ok=True)
        small_jobs(self.source, restart_grace=600)
        self.orgs = prepare(root / "orgs", net, self.source, receive_timeout=600)
        net.forward(api_port)
        self.extra = {"PREFECT_API_URL": f"http://127.0.0.1:{api_port}/api", **extra}
        self.servers = dict(zip(self.orgs, wan.serve_all(net, self.orgs, self.extra), strict=True))
        self.uncut: dict[str, Result] = {}

    def patience(self, restart_grace: float, receive_timeout: float) -> None:
        """Every job file's restart grace and every party's receive timeout, from the next run."""
        for org in self.orgs.values():
            for path in (MAIN, HORIZONTAL):
                job = json.loads((org.folder / path).read_text())
                (org.folder / path).write_text(json.dumps({**job, "restart_grace": restart_grace}))
            text = org.config.read_text()
            old = next(line for line in text.splitlines() if line.startswith("receive_timeout"))
            org.config.write_text(text.replace(old, f"receive_timeout = {receive_timeout}"))

    def require(self, threshold: int | None) -> None:
        """The horizontal job's secure-aggregation threshold, from the next run: the demo's own
        (``None``, dropouts tolerated down to it) or e.g. every hospital (none tolerated)."""
        own = own_threshold()
        for org in self.orgs.values():
            job = json.loads((org.folder / HORIZONTAL).read_text())
            job["horizontal_lr"]["threshold"] = own if threshold is None else threshold
            (org.folder / HORIZONTAL).write_text(json.dumps(job))

    def renew(self, parties: list[str]) -> set[str]:
        """Each party's certificate and key replaced on disk by freshly issued ones (same CA,
        same name), each file moved over the one in use as an operator would; returns the new
        certificates' fingerprints."""
        fingerprints = set()
        for party in parties:
            config = PartyConfig.load(self.orgs[party].config)
            ca = certs.Issued(config.ca, config.ca.with_name("ca.key"))
            fresh = certs.issue(ca, party, self.root / "renewed" / party)
            fingerprints.add(identity.presented(fresh.cert.read_bytes()).fingerprint)
            os.replace(fresh.cert, config.cert)
            os.replace(fresh.key, config.key)
        return fingerprints

    def restart_endpoint(self, party: str) -> None:
        """Kill ``party``'s endpoint (SIGKILL, as a crash) and start it again."""
        server = self.servers[party]
        server.kill()
        server.wait()
        self.servers[party] = wan.start(self.net, self.orgs[party], "serve", [], self.extra)
        stdout = self.servers[party].stdout
        line = stdout.readline() if stdout else ""
        if "serving its messages" not in line:
            raise RuntimeError(f"{party}'s endpoint did not restart: {line!r}")

    def run(self, stage: Stage, run: str, timeout: float = 600) -> Run:
        return Run(self.net, self.orgs, stage.job_file, run, self.extra).start(stage.parties)

    def count(self, stage: Stage, run: str) -> int:
        """Messages ``stage.watch`` has received of ``stage.stage`` in ``run``."""
        folder = self.orgs[stage.watch].messages / job_id(stage.job_file, run, stage.stage)
        return sum(1 for p in (folder / "received").rglob("*") if p.is_file())

    def result(self, stage: Stage, run: str, outcomes: dict[str, Outcome]) -> Result:
        """What ``run`` of ``stage``'s job left: outcomes, models, messages."""
        ids = [job_id(stage.job_file, run, s) for s in stage_ids(stage)]
        found = stored(self.orgs, stage.job_file, run, stage.model_stage)
        models = {
            k: weights(v) for k, v in found.items() if k.split(":", 1)[1].startswith("models/")
        }
        rounds = {k: digest(v) for k, v in found.items() if "/round/" in k}
        return Result(
            outcomes,
            {without_run(key, run): value for key, value in models.items()},
            {without_run(key, run) for key in received(self.orgs, ids)},
            sent_matches(self.orgs, ids),
            {without_run(key, run): value for key, value in rounds.items()},
        )


def stage_ids(stage: Stage) -> tuple[str, ...]:
    """The stages of ``stage``'s job whose messages a case checks."""
    return ("psi", "vertical") if stage.job_file == MAIN else ("horizontal_lr",)


def without_run(key: str, run: str) -> str:
    """A message or model key with its run's suffix taken out: alike across runs."""
    return key.replace(f"-{run}/", "/").removesuffix(f"-{run}")


def digest(value: Any) -> str:
    """SHA-256 of a stored value's encoding, to compare states across runs."""
    return hashlib.sha256(codec.dumps(value, codec.ARTIFACT)).hexdigest()


def weights(stored: dict[str, Any]) -> list[float]:
    """A stored model's intercept (when it holds one) and coefficients, in order."""
    head = [] if stored.get("intercept") is None else [float(stored["intercept"])]
    coefficients = stored["coefficients"]
    values = coefficients.values() if isinstance(coefficients, dict) else coefficients
    return [*head, *(float(w) for w in values)]


@dataclass
class Result:
    """A run's outcome per party, models (key -> weights), received message keys, and the
    received messages whose bytes are not the sender's."""

    outcomes: dict[str, Outcome]
    models: dict[str, list[float]]
    messages: set[str]
    differ: list[str]
    checkpoints: dict[str, str]  # round checkpoint kept -> SHA-256 of its encoded state

    def same_model(self, other: Result) -> bool:
        """Bit for bit: every party's stored weights equal, and the round checkpoints kept
        (a round applied twice would leave other states)."""
        return (
            bool(self.models)
            and self.models == other.models
            and self.checkpoints == other.checkpoints
        )

    def same_messages(self, other: Result) -> bool:
        """The same messages received (none lost, none extra) and each the sender's bytes."""
        return self.messages == other.messages and not self.differ


# ---- one case --------------------------------------------------------------------------------
@dataclass
class Case:
    """A case's figures: each party's outcome first and, when some failed, after a resume."""

    stage: Stage
    action: str  # "cut", "restart", "renew" or "none"
    length: float  # seconds the link stayed cut (0 otherwise)
    first: dict[str, Outcome]
    final: Result
    resumed: bool
    seconds: float
    mid_job: bool  # every party was still running when the interruption began
    renewed: int = 0  # received messages signed with a renewed certificate ("renew")

    def dropped(self) -> list[str]:
        """The parties some round of the final run went on without (horizontal rounds)."""
        found: set[str] = set()
        for outcome in self.final.outcomes.values():
            for stage in outcome.result.get("stages", []):
                for names in stage.get("result", {}).get("dropped", []):
                    found.update(names)
        return sorted(found)


def interrupt(fed: Federation, stage: Stage, action: str, length: float) -> set[str]:
    """Cut ``stage.victim``'s link for ``length`` seconds, restart its endpoint, renew every
    party's certificate (returns the new fingerprints), or (``none``, the control) leave the
    run alone."""
    if action == "renew":
        return fed.renew(stage.parties)
    if action == "restart":
        fed.restart_endpoint(stage.victim)
    if action != "cut":
        return set()
    fed.net.cut(stage.victim)
    try:
        time.sleep(length)
    finally:
        fed.net.restore(stage.victim)
    return set()


def run_case(
    fed: Federation, stage: Stage, action: str, length: float, run: str, timeout: float = 900
) -> Case:
    """Start ``stage``'s job at every party, interrupt it once ``stage.watch`` has received
    ``stage.after`` of its messages, and let it end; if a party failed, resume the run at
    every party (the same command, the same run) once the link is back."""
    started = time.monotonic()
    first_run = fed.run(stage, run)
    wait_for(lambda: fed.count(stage, run) >= stage.after, 300, f"{stage.name} messages")
    mid_job = all(process.poll() is None for process in first_run.processes.values())
    fingerprints = interrupt(fed, stage, action, length)
    first = first_run.finish(timeout)
    outcomes, resumed = first, False
    if any(o.code for o in first.values()):
        outcomes, resumed = fed.run(stage, run).finish(timeout), True
    final = fed.result(stage, run, outcomes)
    seconds = time.monotonic() - started
    ids = [job_id(stage.job_file, run, s) for s in stage_ids(stage)]
    renewed = signed_by(fed.orgs, ids, fingerprints) if fingerprints else 0
    return Case(stage, action, length, first, final, resumed, seconds, mid_job, renewed)


def reference(fed: Federation, stage: Stage, timeout: float = 900) -> Result:
    """An uncut run of ``stage``'s job (once per job file): the model and messages to match."""
    if stage.job_file not in fed.uncut:
        run = f"uncut{len(fed.uncut)}"
        outcomes = fed.run(stage, run).finish(timeout)
        failed = {p: o.reason for p, o in outcomes.items() if o.code}
        if failed:
            raise RuntimeError(f"the uncut run of {stage.job_file} failed: {failed}")
        fed.uncut[stage.job_file] = fed.result(stage, run, outcomes)
    return fed.uncut[stage.job_file]
