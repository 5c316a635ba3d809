"""Test switches: the environment variables that make a process misbehave on purpose.

Tests and benchmarks need runs that fail, hang, crash, release without noise or use short
keys. None of that is a flow parameter or a job-file key, so no deployment form or job file
ever offers it: a switch is read from the environment of the process that runs the flow
(in party mode, one organisation's own process). Every switch but the key size names the
job id it applies to, so a switch set for one job never touches another.

``PRIVREG_INSECURE_TEST_KEYS=1``
    this process makes and accepts Paillier keys below 2048 bits.
``PRIVREG_TEST_FAIL_ROUND=<job id>:<round>``
    ``vertical_lr``: that round fails on the flow run's first try, past its task retries.
``PRIVREG_TEST_FAULTS={"<job id>": {"<round or *>:<stage>": {"<party>": "raise" | "hang"}}}``
    one-process ``horizontal_lr`` and ``sparse_lda``: that party's secure-sum step fails, or
    never answers (JSON; several jobs may be listed).
``PRIVREG_TEST_CRASH_AFTER=<job id>:<round>:<stage or commit>``
    one-process ``horizontal_lr``: the run raises there, as if its process were killed.
``PRIVREG_TEST_PARTY_FAULT=<job id>:<round>:<stage>:kill | raise``
    party mode (``horizontal_lr_party``, ``sparse_lda_party``): this process is killed
    (SIGKILL), or its flow fails, just before that secure-sum stage.
``PRIVREG_TEST_NOISELESS=<job id>[,<job id>...]``
    ``sparse_lda`` (every role) releases exact vectors without noise and charges nothing;
    ``walr`` (every role) accepts ``noise=False``. NOT private; the table's owner must allow
    it too (``privreg policy set ... --allow-noiseless-release``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SMALL_KEYS_VARIABLE = "PRIVREG_INSECURE_TEST_KEYS"
FAIL_ROUND_VARIABLE = "PRIVREG_TEST_FAIL_ROUND"
FAULTS_VARIABLE = "PRIVREG_TEST_FAULTS"
CRASH_VARIABLE = "PRIVREG_TEST_CRASH_AFTER"
PARTY_FAULT_VARIABLE = "PRIVREG_TEST_PARTY_FAULT"
NOISELESS_VARIABLE = "PRIVREG_TEST_NOISELESS"

PARTY_FAULT_KINDS = ("kill", "raise")
STEP_FAULT_KINDS = ("raise", "hang")


class TestSwitchError(ValueError):
    """A test switch's value does not parse; the message names the variable."""

    __test__ = False  # not a test class, whatever pytest's name pattern says


def _value(variable: str) -> str | None:
    return os.environ.get(variable) or None


def _scoped(variable: str, job_id: str, fields: int, form: str) -> list[str] | None:
    """The ``:``-separated fields after ``<job id>:`` when the variable names ``job_id``
    (job ids never contain ``:``); None when it is unset or names another job. The first
    field is always a round, so it must be a number."""
    value = _value(variable)
    if value is None:
        return None
    parts = value.split(":")
    if len(parts) != fields + 1 or not all(parts):
        raise TestSwitchError(f"{variable}={value!r} must be {form}")
    if not parts[1].isdigit():
        raise TestSwitchError(f"{variable}: round {parts[1]!r} is not a number")
    return parts[1:] if parts[0] == job_id else None


def small_keys_allowed() -> bool:
    """Whether this process opted into Paillier keys below 2048 bits.

    Not job-scoped: each party decides for itself whether it accepts a key its data would be
    encrypted under, and in party mode a process's environment is its own organisation's
    (peers' settings never reach it)."""
    return os.environ.get(SMALL_KEYS_VARIABLE) == "1"


def fail_round(job_id: str) -> int | None:
    """The round of ``job_id`` that ``PRIVREG_TEST_FAIL_ROUND`` makes fail, if any."""
    fields = _scoped(FAIL_ROUND_VARIABLE, job_id, 1, "<job id>:<round>")
    return None if fields is None else int(fields[0])


def step_faults(job_id: str) -> dict[str, dict[str, str]]:
    """``job_id``'s entry of ``PRIVREG_TEST_FAULTS``: ``"<round or *>:<stage>"`` to
    ``{party: kind}`` (empty when none). The flow checks the stages and parties it has."""
    value = _value(FAULTS_VARIABLE)
    if value is None:
        return {}
    form = '{"<job id>": {"<round or *>:<stage>": {"<party>": "raise" | "hang"}}}'
    try:
        jobs = json.loads(value)
    except json.JSONDecodeError as error:
        raise TestSwitchError(f"{FAULTS_VARIABLE} is not JSON ({error}); expected {form}") from None
    if not isinstance(jobs, dict) or not all(isinstance(v, dict) for v in jobs.values()):
        raise TestSwitchError(f"{FAULTS_VARIABLE} must be {form}")
    faults = jobs.get(job_id, {})
    for key, parties in faults.items():
        if not isinstance(parties, dict) or not set(parties.values()) <= set(STEP_FAULT_KINDS):
            raise TestSwitchError(
                f"{FAULTS_VARIABLE}[{job_id!r}][{key!r}] must map parties to one of "
                f"{STEP_FAULT_KINDS}, got {parties!r}"
            )
    return faults


def crash_after(job_id: str) -> str | None:
    """``"<round>:<point>"`` where ``PRIVREG_TEST_CRASH_AFTER`` stops ``job_id``'s run."""
    fields = _scoped(CRASH_VARIABLE, job_id, 2, "<job id>:<round>:<stage or commit>")
    return None if fields is None else ":".join(fields)


@dataclass(frozen=True)
class PartyFault:
    """This process's own failure before a secure-sum stage (party mode)."""

    round: int
    stage: str
    kind: str  # "kill" (SIGKILL of this process) or "raise"


def party_fault(job_id: str) -> PartyFault | None:
    """``PRIVREG_TEST_PARTY_FAULT`` when it names ``job_id``."""
    form = "<job id>:<round>:<stage>:kill|raise"
    fields = _scoped(PARTY_FAULT_VARIABLE, job_id, 3, form)
    if fields is None:
        return None
    round_, stage, kind = fields
    if kind not in PARTY_FAULT_KINDS:
        raise TestSwitchError(f"{PARTY_FAULT_VARIABLE}: {':'.join(fields)!r} must be {form}")
    return PartyFault(int(round_), stage, kind)


def noiseless(job_id: str) -> bool:
    """Whether ``PRIVREG_TEST_NOISELESS`` names ``job_id``: its release may be exact (NOT
    private)."""
    value = _value(NOISELESS_VARIABLE)
    if value is None:
        return False
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise TestSwitchError(f"{NOISELESS_VARIABLE}={value!r} must be <job id>[,<job id>...]")
    return job_id in names
