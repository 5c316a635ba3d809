"""Proposals are bounded: a run name is a plain name before any path is built, a peer's
proposals and all proposals run at most their limits' sides at once, Propose and Status take
a share of the caller's endpoint limits, and the service's files are owner-only at birth."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_endpoint_hardening import pki  # noqa: F401 (the module's certificates)
from test_network_channel import config

from federation import certs
from federation.channel import PeerUnreachableError
from federation.endpoint_limits import EndpointLimits
from federation.party_config import PartyConfig
from federation.standing_policy import StandingPolicy
from federation.status import Proposal, ProposalRefusedError
from federation.transport_grpc import GrpcTransport, serve
from privreg import party_service
from privreg.party_service import PartyService


class FakeSide:
    """A started side that runs until the test ends it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.ended = False

    def poll(self) -> int | None:
        return 0 if self.ended else None


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PartyService]:
    """The lab's service; its sides are stand-ins (no pipeline process starts)."""
    monkeypatch.setattr(party_service.subprocess, "Popen", FakeSide)
    folder = tmp_path / "lab"
    (folder / "jobs").mkdir(parents=True)
    (folder / "jobs" / "demo.json").write_text('{"job": "demo"}')
    (folder / "party.toml").write_text("")
    conf = PartyConfig(
        party="lab", root=folder / "home", listen="", ca=Path(), cert=Path(), key=Path(),
        policy=StandingPolicy(accept_from=("clinic", "bank")),
        limits=EndpointLimits(proposals_per_peer=2, proposals_total=3),
    )  # fmt: skip
    before = os.umask(0o022)
    try:
        yield PartyService(conf, folder / "party.toml")
    finally:
        os.umask(before)


def everything(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize("run", ["x/../../../../dir", "..", "a/b", "../x", "x..y", ""])
def test_a_run_name_with_dots_or_a_slash_is_refused_and_creates_nothing(
    service: PartyService, tmp_path: Path, run: str
) -> None:
    before = everything(tmp_path)
    if run == "":  # no run name at all is the job's plain run, and allowed
        assert "started its side of demo " in service("clinic", Proposal("jobs/demo.json"))
        return
    with pytest.raises(ProposalRefusedError, match=r"lab refuses the proposal: run name"):
        service("clinic", Proposal("jobs/demo.json", run))
    assert everything(tmp_path) == before
    assert not service.config.root.exists()


def test_a_peers_proposals_beyond_its_limit_and_all_beyond_the_total_are_refused(
    service: PartyService,
) -> None:
    first = service("clinic", Proposal("jobs/demo.json", "r1"))
    assert "started its side of demo-r1" in first
    service("clinic", Proposal("jobs/demo.json", "r2"))
    assert "already running" in service("clinic", Proposal("jobs/demo.json", "r1"))
    with pytest.raises(
        ProposalRefusedError,
        match=r"2 sides of clinic's proposals are running, the limit is limits.proposals_per_peer "
        r"= 2",
    ):
        service("clinic", Proposal("jobs/demo.json", "r3"))
    service("bank", Proposal("jobs/demo.json", "b1"))  # another peer has its own share
    with pytest.raises(ProposalRefusedError, match=r"limits\.proposals_total = 3"):
        service("bank", Proposal("jobs/demo.json", "b2"))
    service._sides["demo-r1"][1].ended = True  # type: ignore[attr-defined]
    assert "started its side of demo-r3" in service("clinic", Proposal("jobs/demo.json", "r3"))


def test_the_services_umask_folders_and_log_are_owner_only(service: PartyService) -> None:
    os.umask(0o022)  # a umask others can read under: the modes are explicit all the same
    service("clinic", Proposal("jobs/demo.json", "r1"))
    log = service.config.root / "runs" / "demo-r1" / "pipeline.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    for folder in (log.parent, log.parent.parent, service.config.root):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_the_service_sets_an_owner_only_umask(tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        PartyService(replace(PartyConfig("lab", tmp_path, "", Path(), Path(), Path())), tmp_path)
        assert os.umask(0o022) == 0o077
    finally:
        os.umask(before)


def test_propose_and_status_take_a_share_of_the_callers_endpoint_limits(
    pki: dict[str, certs.Issued],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two proposals the service is still deciding hold both of the caller's slots: its third
    proposal and its status question are refused naming the limit; another peer is served."""
    release, entered = threading.Event(), threading.Semaphore(0)

    def deciding(caller: str, proposal: Proposal) -> str:
        entered.release()
        release.wait(20)
        return f"decided {proposal.run}"

    limits = EndpointLimits(fetches_per_peer=2, long_polls_per_peer=1)
    bank = replace(config(pki, "bank", tmp_path, {"ads": 1, "eve": 1}), limits=limits)
    server, port = serve(bank, on_proposal=deciding)
    ads = GrpcTransport(config(pki, "ads", tmp_path, {"bank": port}))
    eve = GrpcTransport(config(pki, "eve", tmp_path, {"bank": port}))
    answers: list[str] = []
    callers = [
        threading.Thread(target=lambda r=r: answers.append(ads.propose("bank", Proposal("j", r))))
        for r in ("r1", "r2")
    ]
    try:
        for thread in callers:
            thread.start()
        for _ in callers:
            assert entered.acquire(timeout=20)
        with pytest.raises(PeerUnreachableError, match=r"2 fetches running.*fetches_per_peer = 2"):
            ads.propose("bank", Proposal("j", "r3"))
        with pytest.raises(PeerUnreachableError, match="RESOURCE_EXHAUSTED"):
            ads.peer_status("job-1", "bank")
        begin = time.monotonic()
        assert eve.peer_status("job-1", "bank") is None  # not held up: no record, NOT_FOUND
        assert time.monotonic() - begin < 2
        release.set()
        for thread in callers:
            thread.join()
        assert sorted(answers) == ["decided r1", "decided r2"]
        assert ads.peer_status("job-1", "bank") is None  # the slots are back
    finally:
        release.set()
        server.stop(None)
