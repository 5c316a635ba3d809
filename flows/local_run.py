"""A local run: every party's side flow in one process, over the shared-folder transport.

More: docs/federation.md (how the parties run a job, and why).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from federation.channel import FileTransport
from federation.party_config import PartyConfig, as_party
from federation.status import Federation, PeerFailedError
from federation.workspace import workspace_root
from storage.descriptor import TableRef
from tasks.reporting import job_name, job_named


@dataclass(frozen=True)
class LocalSide:
    """One party's side of a local run: ``run()`` calls its side flow."""

    party: str
    run: Callable[[], Any]


@dataclass(frozen=True)
class LocalJob:
    """Who takes part in a local run and where its messages go.

    ``job``: the run's name for its federation (each side is heard by the others under it);
    ``None`` when every side flow federates itself (``pipeline_party``). ``tolerated``: parties
    whose failure the protocol survives as a dropout (hospitals of horizontal LR).
    """

    sides: Sequence[LocalSide]
    workspace: str | None = None
    job: str | None = None
    tolerated: tuple[str, ...] = ()
    folder: Path = field(default_factory=Path.cwd)

    @property
    def root(self) -> Path:
        return workspace_root(self.workspace)

    def config(self, party: str) -> PartyConfig:
        peers = [side.party for side in self.sides]
        return PartyConfig.local_party(party, self.root, peers, self.folder)


_CALLER_ATTEMPT: contextvars.ContextVar[int] = contextvars.ContextVar("privreg_attempt", default=1)


def caller_attempt() -> int:
    """Which try of the flow run that started this local run (1 outside one): a retry of that
    run starts new side runs, each on its first try."""
    return _CALLER_ATTEMPT.get()


def run_locally(job: LocalJob) -> dict[str, Any]:
    """Every side at once, each in its own thread; returns each party's result (a tolerated
    party's exception where it failed). Raises the first failure that is a side's own (not a
    peer's report of it), else the first.
    """
    results: dict[str, Any] = {}
    errors: list[tuple[str, BaseException]] = []
    lock = threading.Lock()
    # the sides' runs and artifacts are named after the caller's job (its job file or table)
    name = job_name() if FlowRunContext.get() is not None else None

    def side_thread(side: LocalSide) -> None:
        try:
            with as_party(job.config(side.party)):
                value = _as_side(job, side, name)
            with lock:
                results[side.party] = value
        except BaseException as error:  # reported to the caller, and to peers by its federation
            with lock:
                errors.append((side.party, error))

    attempt = _CALLER_ATTEMPT.set(max(caller_attempt(), flow_run.run_count or 1))
    threads = [  # each copies this context: the caller's attempt, tags and run
        threading.Thread(
            target=contextvars.copy_context().run,
            args=(side_thread, side),
            name=f"side-{side.party}",
            daemon=True,  # a Ctrl-C of the caller ends the run; its pools watch this process
        )
        for side in job.sides
    ]
    _CALLER_ATTEMPT.reset(attempt)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fatal = [(party, error) for party, error in errors if party not in job.tolerated]
    if fatal:
        raise _root_cause(fatal)
    return results | dict(errors)  # a tolerated party's failure: a dropout the run survived


def run_pair(
    first: TableRef,
    second: TableRef,
    side: Callable[[TableRef, str, str], Any],
    workspace: str | None,
    job_id: str,
    roles: tuple[str, str] = ("", ""),
) -> tuple[Any, Any]:
    """A two-party job run locally: ``side(own table, peer's name, role)`` for each of the
    two tables' owners; returns their results in the tables' order."""
    pairs = ((first, second, roles[0]), (second, first, roles[1]))
    sides = [
        LocalSide(own.party, functools.partial(side, own, peer.party, role))
        for own, peer, role in pairs
    ]
    done = run_locally(LocalJob(sides, workspace, job=job_id))
    return done[first.party], done[second.party]


def _as_side(job: LocalJob, side: LocalSide, name: str | None) -> Any:
    if job.job is None:
        return side.run()
    federation = Federation(
        FileTransport(job.root), job.job, side.party, tuple(s.party for s in job.sides),
        tolerated=tuple(p for p in job.tolerated if p != side.party),
    )  # fmt: skip
    with federation.taking_part(), job_named(name) if name else contextlib.nullcontext():
        return side.run()


def _root_cause(errors: list[tuple[str, BaseException]]) -> BaseException:
    """The error a person should read: a side's own failure before its peers' reports of it
    (a peer's failure heard through the federation, or a refusal the peer sent)."""
    own = [
        error
        for _, error in errors
        if not isinstance(error, PeerFailedError) and not getattr(error, "reports_peer", False)
    ]
    return (own or [error for _, error in errors])[0]
