"""What a party's long-running endpoint (``privreg party serve``) does with a proposed job run.

A peer proposes a run (``privreg job start``, its schedule, its deployment): the job file's
path, read from this party's own folder (each organisation holds its own copy; the parties'
terms are compared when the run starts), and the run's name. The service

1. refuses a peer its standing policy does not name (``[policy] accept_from``), and a job file
   that is missing or outside its folder, in one line the proposer prints;
2. otherwise starts this party's side, ``privreg party pipeline --job-file F --run R
   --proposed-by PEER``, as its own process under a lifetime watch (it dies with the service),
   logging to ``<root>/runs/<job>/pipeline.log``. That side checks the job against the rest of
   the policy (flows, epsilon, rows, key size, manual approval) before anything is loaded,
   and a refusal there reaches every party through the job's state.

A proposal for a run whose side is already running here is answered, not started twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from storage.federation import Proposal, ProposalRefusedError
from storage.party_config import PartyConfig

ROOT = Path(__file__).resolve().parents[1]


class PartyService:
    """The endpoint's ``on_proposal``: decide, then start this party's side of the run."""

    def __init__(self, config: PartyConfig, config_path: Path) -> None:
        self.config, self.config_path = config, config_path.resolve()
        self.folder = self.config_path.parent
        self._sides: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def __call__(self, caller: str, proposal: Proposal) -> str:
        party, policy = self.config.party, self.config.policy
        if not policy.accepts_proposals_from(caller):
            raise ProposalRefusedError(
                f"{party} takes no proposals from {caller} (policy.accept_from is "
                f"{list(policy.accept_from)} in its party.toml)"
            )
        job_file = (self.folder / proposal.job_file).resolve()
        if not job_file.is_relative_to(self.folder) or not job_file.is_file():
            raise ProposalRefusedError(
                f"{party} holds no job file {proposal.job_file!r} in its folder"
            )
        name = _job_name(job_file) + (f"-{proposal.run}" if proposal.run else "")
        with self._lock:
            for done in [n for n, side in self._sides.items() if side.poll() is not None]:
                del self._sides[done]  # reaped: no zombie stays behind
            running = self._sides.get(name)
            if running is not None and running.poll() is None:
                return f"{party} is already running its side of {name}"
            log = self.config.root / "runs" / name / "pipeline.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            self._sides[name] = self._start(proposal, caller, log)
        return f"{party} started its side of {name} (log {log})"

    def _start(self, proposal: Proposal, caller: str, log: Path) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "core.lifetime", str(os.getpid()),
            "-m", "privreg.cli", "party", "pipeline", "--config", str(self.config_path),
            "--job-file", proposal.job_file, "--proposed-by", caller,
            *(["--run", proposal.run] if proposal.run else []),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )}  # fmt: skip
        with log.open("ab") as out:
            return subprocess.Popen(
                command, cwd=self.folder, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        """End every side this service started (each tells its peers it was interrupted)."""
        with self._lock:
            for side in self._sides.values():
                if side.poll() is None:
                    side.terminate()
            for side in self._sides.values():
                try:
                    side.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    side.kill()


def _job_name(job_file: Path) -> str:
    """The job's name as its file gives it (its ``job``, else the file's stem)."""
    try:
        return str(json.loads(job_file.read_text()).get("job") or job_file.stem)
    except (OSError, ValueError, AttributeError):
        return job_file.stem
