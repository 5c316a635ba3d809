"""A link cut for a few seconds and an endpoint restarted mid-job lose nothing: on the WAN
harness (benchmarks/wan.py), the demo's small main job (PSI, then one vertical LR epoch) ends
done at every party with the model of an uncut run, bit for bit (and its round checkpoints),
and every message received once, as its sender sent it. The full matrix (60 s cuts, cuts past
the restart grace and resumes, horizontal rounds) is ``make bench-partitions``.

Needs root and ``ip netns``; skipped with the reason elsewhere. One set of organisations (the
clinic, the lab, the arbiter, each in its own namespace) serves the whole module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks import partitions, wan
from demo.parties import SMALL_KEYS

pytestmark = pytest.mark.skipif(bool(wan.available()), reason=str(wan.available()))

LINK = wan.Setting("test", 100, 4)


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


def test_a_five_second_cut_during_psi_loses_nothing(fed: partitions.Federation) -> None:
    case = partitions.run_case(fed, partitions.PSI, "cut", 5.0, "cut5")
    check_lost_nothing(fed, case)
    assert case.seconds > 5.0


def test_an_endpoint_restarted_during_a_vertical_round_loses_nothing(
    fed: partitions.Federation,
) -> None:
    check_lost_nothing(fed, partitions.run_case(fed, partitions.VERTICAL, "restart", 0, "restart"))
