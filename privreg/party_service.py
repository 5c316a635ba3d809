"""What a party's long-running endpoint (``privreg party serve``) does with a proposed job run.

A peer proposes a run (``privreg job start``, its schedule, its deployment): the job file's
path, read from this party's own folder (each organisation holds its own copy; the parties'
terms are compared when the run starts), and the run's name. The service

1. refuses a peer its standing policy does not name (``[policy] accept_from``), unless the
   proposal restarts a run this party already took part in with that peer (its own record of
   the run names both: ``privreg job resume`` at a party whose side went down), a run name
   that is not a plain name (``federation.channel.check_name``: no ``/``, no ``..``; checked
   before any path is built), a job file that is missing or outside its folder, and a side
   beyond its limits (``[limits] proposals_per_peer``, ``proposals_total``: sides started by
   proposals and still running), in one line the proposer prints;
2. otherwise starts this party's side, ``privreg party pipeline --job-file F --run R
   --proposed-by PEER``, as its own process under a lifetime watch (it dies with the service),
   logging to ``<root>/runs/<job>-<run>/pipeline.log``, with the organisation's Prefect server
   in its ``PREFECT_API_URL`` (``privreg.org_prefect``: the side reports there as a flow run
   instead of starting a temporary server of its own). That side checks the job against the
   rest of the policy (flows, epsilon, rows, key size, manual approval) before anything is
   loaded, and a refusal there reaches every party through the job's state.

A proposal for a run whose side is already running here is answered, not started twice. The
service's files are its owner's only from their first byte: the process's umask is 077 from
the service's start, and its folders and logs are created 0700 and 0600 explicitly.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

from core.lifetime import installation_env, watched_command
from federation.channel import MessageFolder, check_name
from federation.party_config import PartyConfig
from federation.status import Proposal, ProposalRefusedError, status_parties
from privreg.org_prefect import OrgPrefect, OrgPrefectError
from storage.party_store import owner_only_umask, private_dirs

REAP_EVERY = 0.5  # seconds between looks for ended sides


class PartyService:
    """The endpoint's ``on_proposal``: decide, then start this party's side of the run."""

    def __init__(
        self, config: PartyConfig, config_path: Path, prefect: OrgPrefect | None = None
    ) -> None:
        owner_only_umask()  # before the service creates anything
        self.config, self.config_path = config, config_path.resolve()
        self.prefect = prefect  # the organisation's server (None: each side starts its own)
        self.folder = self.config_path.parent
        self._sides: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}  # run -> proposer, side
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None

    def __call__(self, caller: str, proposal: Proposal) -> str:
        party, policy = self.config.party, self.config.policy
        run = _plain(party, proposal.run, "run name") if proposal.run else ""
        job_file = (self.folder / proposal.job_file).resolve()
        held = job_file.is_relative_to(self.folder) and job_file.is_file()
        name = _job_name(job_file) + (f"-{run}" if run else "") if held else ""
        restart = held and self._took_part(_plain(party, name, "job run"), caller)
        if not policy.accepts_proposals_from(caller) and not restart:
            raise ProposalRefusedError(  # the same words whatever the folder holds
                f"{party} takes no proposals from {caller} (policy.accept_from is "
                f"{list(policy.accept_from)} in its party.toml)"
            )
        if not held:
            raise ProposalRefusedError(
                f"{party} holds no job file {proposal.job_file!r} in its folder"
            )
        env = self._prefect_env()  # before the lock: it may wait for the server's start
        with self._lock:
            self._reap()
            running = self._sides.get(name)
            if running is not None:
                return f"{party} is already running its side of {name}"
            self._check_limits(caller, name)
            log = self.config.root / "runs" / name / "pipeline.log"
            self._sides[name] = (caller, self._start(proposal, caller, log, env))
            self._start_reaper()
        return f"{party} started its side of {name} (log {log})"

    def _prefect_env(self) -> dict[str, str]:
        """The organisation's Prefect for a side's environment (none: the side's own)."""
        if self.prefect is None:
            return {}
        try:
            return self.prefect.side_environment()
        except OrgPrefectError as error:
            raise ProposalRefusedError(str(error)) from None

    def _took_part(self, name: str, caller: str) -> bool:
        """Whether this party already took part in run ``name`` with ``caller`` (its own
        record of the run names both): a restart of that run, which this party agreed to
        when it started, is not a new proposal for the standing policy to judge."""
        data = MessageFolder(self.config.root).read_status(name, self.config.party)
        return data is not None and caller in status_parties(data)

    def _reap(self) -> None:
        """Forget sides that ended (``poll`` reaps them: no zombie stays behind)."""
        for done in [n for n, (_, side) in self._sides.items() if side.poll() is not None]:
            del self._sides[done]

    def _start_reaper(self) -> None:
        """Reap ended sides every :data:`REAP_EVERY` seconds, not only at the next proposal:
        an ended side left unreaped is a ``<defunct>`` process that ``ps`` shows as alive."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
            self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._closed.wait(REAP_EVERY):
            with self._lock:
                self._reap()

    def _check_limits(self, caller: str, name: str) -> None:
        """Refuse a side beyond ``limits.proposals_per_peer`` (from ``caller``) or
        ``limits.proposals_total``, naming the limit: each side is a process with its own
        Prefect and pools, so a peer must not be able to start them without bound."""
        limits, party = self.config.limits, self.config.party
        mine = sum(1 for proposer, _ in self._sides.values() if proposer == caller)
        for held, limit, whose in (
            (mine, "proposals_per_peer", f"{caller}'s proposals"),
            (len(self._sides), "proposals_total", "proposals"),
        ):
            value = getattr(limits, limit)
            if held >= value:
                raise ProposalRefusedError(
                    f"{party} refuses {name}: {held} sides of {whose} are running, the limit "
                    f"is limits.{limit} = {value}; propose it again when one ends"
                )

    def _start(
        self, proposal: Proposal, caller: str, log: Path, prefect_env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        command = watched_command([
            "privreg.cli", "party", "pipeline", "--config", str(self.config_path),
            "--job-file", proposal.job_file, "--proposed-by", caller,
            *(["--run", proposal.run] if proposal.run else []),
        ])  # fmt: skip
        env = installation_env({**os.environ, **prefect_env})
        private_dirs(log.parent)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            return subprocess.Popen(
                command, cwd=self.folder, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        finally:
            os.close(out)

    def stop(self) -> None:
        """End every side this service started (each tells its peers it was interrupted)."""
        self._closed.set()
        with self._lock:
            for _, side in self._sides.values():
                if side.poll() is None:
                    side.terminate()
            for _, side in self._sides.values():
                try:
                    side.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    side.kill()


def _plain(party: str, value: str, what: str) -> str:
    """``value`` if it is a plain name (safe as one path component), else a refusal."""
    try:
        return check_name(value, what)
    except ValueError as error:
        raise ProposalRefusedError(f"{party} refuses the proposal: {error}") from None


def _job_name(job_file: Path) -> str:
    """The job's name as its file gives it (its ``job``, else the file's stem)."""
    try:
        return str(json.loads(job_file.read_text()).get("job") or job_file.stem)
    except (OSError, ValueError, AttributeError):
        return job_file.stem
