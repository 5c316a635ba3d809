"""A link cut for a few seconds and an endpoint restarted mid-job lose nothing: on the WAN
harness (benchmarks/wan.py), the demo's small main job (PSI, then one vertical LR epoch) ends
done at every party with the model of an uncut run, bit for bit (and its round checkpoints),
and every message received once, as its sender sent it. The full matrix (60 s cuts, cuts past
the restart grace and resumes, horizontal rounds, certificate renewals) is
``make bench-partitions``.

Those tests need root and ``ip netns``; they skip with the reason elsewhere. One set of
organisations (the clinic, the lab, the arbiter, each in its own namespace) serves them all.

The benchmark's horizontal long cut with every hospital required showed surviving hospitals
giving up on a coordinator that was alive, waiting out a stage's deadline for the cut one:
the last tests check, in one process, that a hospital waits that long for its messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import partitions, wan
from core.job_schema import HorizontalOptions
from demo.parties import SMALL_KEYS
from federation.channel import Channel
from storage.descriptor import TableRef
from tasks import horizontal_party, secure_rounds
from tasks.horizontal_lr import rounds_job
from tasks.secure_sum import COORDINATOR, RoundStateError

needs_wan = pytest.mark.skipif(bool(wan.available()), reason=str(wan.available()))
LINK = wan.Setting("test", 100, 4)
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")


@pytest.fixture(scope="module")
def fed(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: None
) -> Iterator[partitions.Federation]:
    """The main job's organisations on the harness, serving, with an uncut run done."""
    from prefect.settings import PREFECT_API_URL

    port = int(str(PREFECT_API_URL.value()).split(":")[-1].split("/")[0])
    with wan.Wan(partitions.MAIN_PARTIES, LINK) as net:
        made = partitions.Federation(tmp_path_factory.mktemp("wan"), net, port, SMALL_KEYS)
        partitions.reference(made, partitions.VERTICAL)
        yield made


def check_lost_nothing(fed: partitions.Federation, case: partitions.Case) -> None:
    uncut = partitions.reference(fed, case.stage)
    reasons = {party: outcome.reason for party, outcome in case.first.items()}
    assert case.mid_job, "the job ended before the interruption: the case tested nothing"
    assert not case.resumed and all(o.code == 0 for o in case.first.values()), reasons
    assert uncut.models and uncut.checkpoints  # something to compare
    assert case.final.same_model(uncut), (case.final.models, uncut.models)
    assert case.final.messages == uncut.messages, case.final.messages ^ uncut.messages
    assert case.final.differ == []


@needs_wan
def test_a_five_second_cut_during_psi_loses_nothing(fed: partitions.Federation) -> None:
    case = partitions.run_case(fed, partitions.PSI, "cut", 5.0, "cut5")
    check_lost_nothing(fed, case)
    assert case.seconds > 5.0


@needs_wan
def test_an_endpoint_restarted_during_a_vertical_round_loses_nothing(
    fed: partitions.Federation,
) -> None:
    check_lost_nothing(fed, partitions.run_case(fed, partitions.VERTICAL, "restart", 0, "restart"))


def test_a_hospital_waits_out_the_stage_deadline_for_the_coordinators_unmask_request(
    tmp_path: Path,
) -> None:
    """A survivor's receive timeout shorter than the job's stage timeout: the coordinator,
    waiting out the stage's deadline for a cut-off hospital, sends the request late; the
    survivor takes it instead of failing the round, naming the coordinator."""
    channel = Channel(tmp_path, "job-waits", timeout=0.2)  # the party's own receive timeout
    job = rounds_job("job-waits", HOSPITALS, 2, 4, stage_timeout=3.0)  # the job's terms
    hospital, coordinator = channel.endpoint("hospital_b"), channel.endpoint(COORDINATOR)
    late = threading.Timer(
        1.5, lambda: coordinator.send("hospital_b", secure_rounds.REQUEST, {"round": 3}, round=3)
    )
    late.start()
    started = time.monotonic()
    try:
        assert horizontal_party._await_request(hospital, job, 3)
    finally:
        late.cancel()
    assert time.monotonic() - started >= 1.5
    # dropped: the round's model is out and no request came, so the wait ends at once
    coordinator.send("hospital_b", "model", {"round": 4}, round=4)
    started = time.monotonic()
    assert not horizontal_party._await_request(hospital, job, 4)
    assert time.monotonic() - started < 1.5


def test_a_hospital_waits_out_two_stage_deadlines_for_the_rounds_model(tmp_path: Path) -> None:
    """The model comes after the answers' stage, which the coordinator may also wait out: a
    model sent later than the survivor's receive timeout is still taken (here one of another
    round, which the hospital then refuses by name rather than timing out)."""
    channel = Channel(tmp_path, "job-model", timeout=0.2)
    job = rounds_job("job-model", HOSPITALS, 2, 4, stage_timeout=1.0)
    side = horizontal_party.Hospital(
        TableRef(database=str(tmp_path / "b.duckdb"), table="patients", party="hospital_b"),
        channel.endpoint("hospital_b"), HOSPITALS, (), 4, HorizontalOptions(),
    )  # fmt: skip
    coordinator = channel.endpoint(COORDINATOR)
    late = threading.Timer(1.5, lambda: coordinator.send("hospital_b", "model", {"round": 9}, 3))
    late.start()
    try:
        with pytest.raises(RoundStateError, match="the model message of round 3 is another's"):
            horizontal_party._finish(side, job, 3, None)  # type: ignore[arg-type]
    finally:
        late.cancel()
