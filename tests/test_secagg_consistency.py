"""The consistency round (Bonawitz et al. 2017, round 3): a coordinator that tells senders
different survivor sets gets no secret out of an honest hospital; the terms are the job's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.job_schema import HorizontalOptions
from core.secagg import multiround as mr
from core.secagg import wire
from core.secagg.errors import ProtocolViolationError
from core.secagg.simulation import run_round, start_job
from federation.workspace import channel_for
from storage.party_store import PartyStore
from tasks import secure_rounds
from tasks import secure_rounds_coordinator as rounds_coordinator
from tasks import secure_rounds_party as rounds_party
from tasks.horizontal_coordinator import Coordinator, _call_round
from tasks.secure_sum import COORDINATOR, collect, coordinator_store

RNG = np.random.default_rng(36)


def names_of(n: int) -> list[str]:
    return [f"h{i:02d}" for i in range(n)]


def masked_round(n: int) -> tuple[Any, dict[str, mr.MaskedInput], dict[str, mr.UnmaskRequest]]:
    """A job of ``n`` hospitals whose round 0 every one masked; the honest requests."""
    names = names_of(n)
    job = start_job(mr.new_job(f"split-{n}", names, 4))
    job.coordinator, starts = mr.open_round(job.coordinator, 0)
    inputs = {}
    for party, start in starts.items():
        job.parties[party] = mr.start_round(job.parties[party], start)
        ring = RNG.integers(0, 2**64, size=4, dtype=np.uint64)
        job.parties[party], inputs[party] = mr.mask_ring_round(job.parties[party], ring)
    job.coordinator, requests = mr.collect_inputs(job.coordinator, list(inputs.values()))
    return job, inputs, requests


def told_dropped(request: mr.UnmaskRequest, gone: set[str]) -> mr.UnmaskRequest:
    """``request`` as a coordinator rewrites it to claim ``gone`` dropped."""
    return dataclasses.replace(
        request,
        senders=tuple(p for p in request.senders if p not in gone),
        dropped=tuple(sorted({*request.dropped, *gone})),
        shares={k: v for k, v in request.shares.items() if k not in gone},
    )


def split_requests(job: Any, requests: dict[str, mr.UnmaskRequest]) -> dict[str, Any]:
    """The attack of issue 36: victim u is told t - 1 neighbours D dropped (it would reveal
    its round seeds with them), D the truth (they would reveal shares of u's self-mask), u's
    other neighbours W that u dropped (they would reveal their seeds with u)."""
    config = job.config
    victim = config.parties[0]
    neighbours = list(config.neighbours[victim])
    dropped, others = (
        set(neighbours[: config.threshold - 1]),
        set(neighbours[config.threshold - 1 :]),
    )
    told = {victim: told_dropped(requests[victim], dropped)}
    told |= {p: told_dropped(requests[p], {victim}) for p in others}
    return {"victim": victim, "W": others, "told": {**requests, **told}}


def relay_all(views: dict[str, mr.SurvivorView], party: str) -> dict[str, mr.SurvivorView]:
    return views  # the coordinator forwards every signed view it got


def relay_agreeing(views: dict[str, mr.SurvivorView], party: str) -> dict[str, mr.SurvivorView]:
    """The coordinator forwards to each party only the views that tell its own story."""
    own = views[party]
    return {p: v for p, v in views.items() if (v.senders, v.dropped) == (own.senders, own.dropped)}


@pytest.mark.parametrize("relay", [relay_all, relay_agreeing])
@pytest.mark.parametrize("n", [3, 10, 20])
def test_a_split_survivor_set_is_refused_before_any_secret_leaves(n: int, relay: Any) -> None:
    job, _, requests = masked_round(n)
    attack = split_requests(job, requests)
    victim, told = attack["victim"], attack["told"]
    views = {}
    for party, request in told.items():  # signing a view reveals nothing
        job.parties[party], views[party] = mr.sign_view(job.parties[party], request)
    answers, refusals = {}, {}
    for party, request in told.items():
        try:
            _, answers[party] = mr.answer_unmask(job.parties[party], request, relay(views, party))
        except ProtocolViolationError as error:
            refusals[party] = str(error)
    # the victim and every neighbour told it dropped refuse, naming the coordinator
    assert {victim, *attack["W"]} <= set(refusals)
    assert all("refused before revealing anything, the coordinator" in e for e in refusals.values())
    if relay is relay_all:  # everyone sees the split
        assert not answers and any("split the round's survivor set" in e for e in refusals.values())
    # nothing that strips the victim's pair masks left anyone: no seed with it, none of its own
    assert all(victim not in a.pair_seeds for a in answers.values())
    assert victim not in answers


def test_the_honest_round_with_dropouts_still_equals_the_clear_sum() -> None:
    names = names_of(10)
    job = start_job(mr.new_job("consistent", names, 4))
    vectors = {p: RNG.integers(0, 2**64, size=4, dtype=np.uint64) for p in names}
    gone = names[3]  # before masking; then a sender that is not its neighbour before unmasking
    late = next(p for p in names if p != gone and p not in job.config.neighbours[gone])
    result = run_round(job, 0, vectors, silent_at_mask={gone}, silent_at_unmask={late})
    assert late in result.senders
    expected = np.zeros(4, dtype=np.uint64)
    for party in result.senders:
        expected += vectors[party]
    np.testing.assert_array_equal(result.ring_sum, expected)


def test_too_few_views_or_a_view_under_another_name_are_refused() -> None:
    job, _, requests = masked_round(5)
    views = {}
    for party, request in requests.items():
        job.parties[party], views[party] = mr.sign_view(job.parties[party], request)
    party = job.config.parties[0]
    few = dict(list(views.items())[: mr.view_quorum(job.config) - 1])
    with pytest.raises(ProtocolViolationError, match="fewer than the 3 the job's terms need"):
        mr.answer_unmask(job.parties[party], requests[party], few)
    renamed = {**views, "h01": views["h02"]}
    with pytest.raises(ProtocolViolationError, match=r"relayed a view of 'h02' .* as 'h01''s"):
        mr.answer_unmask(job.parties[party], requests[party], renamed)
    # and a party signs one view a round: a second, different request is refused
    other = told_dropped(requests[party], {"h04"})
    with pytest.raises(ProtocolViolationError, match="different request for this round"):
        mr.sign_view(job.parties[party], other)


def agreed_record(job: secure_rounds.RoundsJob, party: str) -> dict[str, Any]:
    state, _ = mr.join(job.config(), party)
    return {"state": wire.party_state_to_plain(state), "terms": job.terms()}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"threshold": 2}, "threshold 2, not the agreed 3"),
        ({"stage_timeout": 5.0}, "stage_timeout 5.0, not the agreed 30.0"),
        ({"parties": ("a", "b", "c", "d", "e")}, "parties"),
    ],
)
def test_a_call_that_changes_the_agreed_terms_is_refused(change: dict, named: str) -> None:
    agreed = secure_rounds.RoundsJob("horizontal", "terms", ("a", "b", "c", "d"), 3, 4)
    agreed = dataclasses.replace(agreed, stage_timeout=30.0)
    record = agreed_record(agreed, "a")
    assert rounds_party.party_state(record, agreed).party == "a"
    called = dataclasses.replace(agreed, **change)
    with pytest.raises(ProtocolViolationError, match="the coordinator's call for job terms") as e:
        rounds_party.party_state(record, called)
    assert named in str(e.value) and "refused" in str(e.value)


def test_a_forged_view_in_the_relay_is_refused_naming_the_coordinator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the local run's shared folder the relayed views are checked against the
    originals there: one view altered by the coordinator stops every sender before it
    answers."""
    from federation.channel import Channel
    from storage import codec

    parties = ("hospital_a", "hospital_b", "hospital_c")
    channel = channel_for("view-job", str(tmp_path))
    ends = {p: channel.endpoint(p) for p in (*parties, COORDINATOR)}
    coordinator = ends[COORDINATOR]
    options = HorizontalOptions(learning_rate=0.2, l2=0.0, stage_timeout=30.0)
    side = Coordinator(coordinator, coordinator_store(str(tmp_path)), parties, 2, options, 2)
    job = side.job
    stores = {p: PartyStore(tmp_path / f"{p}.duckdb") for p in parties}
    stores[COORDINATOR] = side.store
    for party in parties:
        rounds_party.party_join(stores[party], job, ends[party], 0, agreed=True)
    keys = collect(coordinator, secure_rounds.JOB_KEYS, list(parties), 0, 5.0)
    rounds_coordinator.coordinator_admit(stores[COORDINATOR], job, keys)
    call = _call_round(side, 0)
    for party in parties:
        start = rounds_party.round_start(job, 0, call.protocol, party)
        rounds_party.party_mask(stores[party], job, ends[party], start, np.arange(5.0))
    masked = collect(coordinator, secure_rounds.MASKED, list(parties), 0, 5.0)
    rounds_coordinator.coordinator_collect(
        stores[COORDINATOR], job, coordinator, 0, masked, views=False
    )
    real_write = Channel._write_each

    def forge(self: Channel, r: int, sender: str, kind: str, payloads: dict[str, Any]) -> Any:
        if sender == COORDINATOR and kind == secure_rounds.VIEW_RELAY:
            for entries in payloads.values():
                view = codec.loads(entries["hospital_b"]["data"])
                view["dropped"] = ["hospital_c"]
                entries["hospital_b"] = {**entries["hospital_b"], "data": codec.dumps(view)}
        return real_write(self, r, sender, kind, payloads)

    monkeypatch.setattr(Channel, "_write_each", forge)
    requests = {}
    for party in parties:
        requests[party] = ends[party].receive(COORDINATOR, secure_rounds.REQUEST, round=0)
        rounds_party.party_view(stores[party], job, ends[party], 0, requests[party])
    rounds_coordinator.coordinator_relay_views(stores[COORDINATOR], job, coordinator, 0)
    with pytest.raises(ProtocolViolationError, match="relay of the survivor views") as refused:
        rounds_party.party_answer(
            stores["hospital_a"], job, ends["hospital_a"], 0, requests["hospital_a"]
        )
    assert "from hospital_b to coordinator" in str(refused.value)
    assert (
        coordinator.channel.transport.store().find(
            coordinator.channel.key(0, "hospital_a", COORDINATOR, secure_rounds.RESPONSE)
        )
        is None
    )  # it sent no answer
