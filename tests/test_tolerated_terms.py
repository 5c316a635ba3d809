"""A hospital whose state record carries another terms digest is a dropout in a job that
tolerates dropouts (its messages are refused anyway): it is dropped and the job goes on; the
coordinator, whose terms every hospital needs, still ends every side."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from federation.channel import FileTransport
from federation.status import Federation, PeerFailedError

PARTIES = ("coordinator", "hospital_a", "hospital_b")


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
