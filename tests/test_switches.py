"""The test switches (core/test_switches.py): a switch applies to the job it names only, and a
value that does not parse is refused naming its variable."""

from __future__ import annotations

import json

import pytest

from core import test_switches as switches
from tasks.secure_sum import Faults

FAULT = {"1:mask_input": {"hospital_b": "hang"}}


def test_a_switch_touches_only_the_job_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(switches.FAIL_ROUND_VARIABLE, "job-a:3")
    monkeypatch.setenv(switches.FAULTS_VARIABLE, json.dumps({"job-a": FAULT}))
    monkeypatch.setenv(switches.CRASH_VARIABLE, "job-a:2:commit")
    monkeypatch.setenv(switches.PARTY_FAULT_VARIABLE, "job-a:0:mask_input:kill")
    monkeypatch.setenv(switches.NOISELESS_VARIABLE, "job-c,job-a")
    assert switches.fail_round("job-a") == 3
    assert switches.step_faults("job-a") == FAULT and switches.crash_after("job-a") == "2:commit"
    assert switches.party_fault("job-a") == switches.PartyFault(0, "mask_input", "kill")
    assert switches.noiseless("job-a") and switches.noiseless("job-c")
    faults = Faults.of_job("job-a", ["hospital_a", "hospital_b"])
    assert faults.at(1, "mask_input") == {"hospital_b": "hang"} and faults.at(0, "mask_input") == {}
    # another job, including one whose id starts like a named one: untouched
    for other in ("job-b", "job"):
        assert switches.fail_round(other) is None and switches.step_faults(other) == {}
        assert switches.crash_after(other) is None and switches.party_fault(other) is None
        assert not switches.noiseless(other)
        assert Faults.of_job(other, ["hospital_a", "hospital_b"]) == Faults()


@pytest.mark.parametrize(
    ("variable", "value", "read"),
    [
        (switches.FAIL_ROUND_VARIABLE, "job-a", switches.fail_round),
        (switches.FAIL_ROUND_VARIABLE, "job-a:three", switches.fail_round),
        (switches.FAULTS_VARIABLE, "{job-a: 1}", switches.step_faults),
        (switches.FAULTS_VARIABLE, '["job-a"]', switches.step_faults),
        (
            switches.FAULTS_VARIABLE,
            '{"job-a": {"0:mask_input": {"h": "kill"}}}',
            switches.step_faults,
        ),
        (switches.CRASH_VARIABLE, "job-a:commit", switches.crash_after),
        (switches.PARTY_FAULT_VARIABLE, "job-a:0:mask_input:explode", switches.party_fault),
        (switches.NOISELESS_VARIABLE, "job-a,,job-b", switches.noiseless),
    ],
)
def test_a_value_that_does_not_parse_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, read: object
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(switches.TestSwitchError, match=variable):
        read("job-a")  # type: ignore[operator]


def test_faults_of_a_job_name_a_stage_and_parties_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["hospital_a", "hospital_b"]
    monkeypatch.setenv(
        switches.FAULTS_VARIABLE, json.dumps({"j": {"0:unmask": {"hospital_a": "raise"}}})
    )
    with pytest.raises(
        switches.TestSwitchError, match=f"{switches.FAULTS_VARIABLE}: key '0:unmask'"
    ):
        Faults.of_job("j", names)
    monkeypatch.setenv(
        switches.FAULTS_VARIABLE, json.dumps({"j": {"*:mask_input": {"h_z": "raise"}}})
    )
    with pytest.raises(switches.TestSwitchError, match=r"unknown parties \['h_z'\]"):
        Faults.of_job("j", names)
    monkeypatch.delenv(switches.FAULTS_VARIABLE)
    monkeypatch.setenv(switches.CRASH_VARIABLE, "j:0:somewhere")
    with pytest.raises(switches.TestSwitchError, match=switches.CRASH_VARIABLE):
        Faults.of_job("j", names)
