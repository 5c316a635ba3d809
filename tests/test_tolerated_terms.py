"""A hospital whose state record carries another terms digest is a dropout in a job that
tolerates dropouts (its messages are refused anyway): it is dropped and the job goes on; the
coordinator, whose terms every hospital needs, still ends every side."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from core.job_files import read_job
from federation.channel import FileTransport
from federation.party_config import PartyConfig
from federation.status import Federation, PeerFailedError
from flows.pipeline_party import PartyJob

PARTIES = ("coordinator", "hospital_a", "hospital_b")
ROOT = Path(__file__).resolve().parents[1]


def sides(root: Path, digests: dict[str, str]) -> dict[str, Federation]:
    transport = FileTransport(root)
    return {p: side(transport, p, digests.get(p, "agreed")) for p in PARTIES}


def side(transport: FileTransport, party: str, digest: str) -> Federation:
    return Federation(
        transport, "hlr", party, PARTIES, digest=digest, interval=0.05, tolerated=PARTIES[1:],
        tolerated_every=0.1,
    )  # fmt: skip


def run(made: dict[str, Federation]) -> None:
    for side in made.values():
        side.start()
    time.sleep(0.6)


def test_a_tolerated_party_with_other_terms_is_dropped_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    made = sides(tmp_path, {"hospital_a": "other"})
    try:
        run(made)
        for party in ("coordinator", "hospital_b"):
            made[party].check()  # goes on
            shown = {row["party"]: row["state"] for row in made[party].table()}
            assert shown["hospital_a"].endswith("(dropped: the job goes on)"), shown
            assert made[party].peers["hospital_a"].dropped.startswith("holds other terms")
    finally:
        for side in made.values():
            side.finish()


def test_a_coordinator_with_other_terms_still_ends_every_hospital(tmp_path: Path) -> None:
    made = sides(tmp_path, {"coordinator": "other"})
    try:
        run(made)
        with pytest.raises(PeerFailedError, match="party coordinator holds other terms"):
            made["hospital_b"].check()
    finally:
        for side in made.values():
            side.finish()


@pytest.mark.parametrize(("threshold", "tolerated"), [(None, 3), (2, 3), (3, 0)])
def test_hospitals_are_tolerated_only_where_the_threshold_lets_one_drop(
    tmp_path: Path, threshold: int | None, tolerated: int
) -> None:
    """A job whose threshold requires every hospital tolerates none: a cut-off hospital fails
    the job at every party within the restart grace, named, instead of after a stage's wait."""
    spec = read_job(ROOT / "jobs" / "horizontal_demo.json")
    spec["horizontal_lr"]["threshold"] = threshold
    config = PartyConfig(
        party="hospital_a", root=tmp_path, listen="", ca=Path(), cert=Path(), key=Path()
    )
    job = PartyJob("horizontal_lr", spec["job"], spec, config, ROOT / "jobs", None)
    assert len(job.droppable()) == tolerated
    assert "coordinator" not in job.droppable()
