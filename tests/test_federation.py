"""A job is one federation-wide object: agreed terms, one state, failures that reach everyone.

In one process (the shared folder transport): a peer's failure, an operator's abort and a
vanished peer are heard by :class:`Federation`, and the channel's waits end on them. With each
organisation its own process over mTLS (one set of organisations for the module): a job file
that differs in one option is refused at every party before anything is loaded, and a guest
that fails at set-up ends its peers' sides within seconds, each naming the guest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from core.job_files import read_job
from core.job_terms import PROTOCOL_VERSION, differences, digest, job_terms, protocol_mismatch
from core.lifetime import descendants
from demo.orgs import Org, env_of, serve_all, start, stop_all
from demo.parties import SMALL_KEYS, prepare, small_main_job
from federation import watchers
from federation.channel import Channel, FileTransport, MessageTimeoutError, TermsBindingError
from federation.status import Federation, PeerFailedError, SideEndedError, request_abort
from storage import codec

ROOT = Path(__file__).resolve().parents[1]


# ---- terms -------------------------------------------------------------------------------------
def test_terms_leave_out_private_paths_and_name_each_difference() -> None:
    spec = read_job(ROOT / "jobs/demo.json")
    other = json.loads(json.dumps(spec))
    other["parties"]["host"]["source"] = "elsewhere/lab.csv"  # an organisation's own layout
    other["parties"]["host"]["table"]["database"] = "db/lab.duckdb"
    assert digest(job_terms("main", spec, None)) == digest(job_terms("main", other, None))
    other["vertical"]["epochs"] = 5
    other["walr"].pop("clip_norm")
    found = differences(job_terms("main", spec, None), job_terms("main", other, None))
    assert [d.describe("clinic", "lab") for d in found] == [
        "job.vertical.epochs: clinic has 4, lab has 5",
        "job.walr.clip_norm: clinic has 4.0, lab has (not set)",
    ]
    assert digest(job_terms("main", spec, "nightly")) != digest(job_terms("main", spec, None))


def test_terms_of_another_protocol_version_are_refused_naming_both_versions() -> None:
    spec = read_job(ROOT / "jobs/demo.json")
    mine = job_terms("main", spec, None)
    assert mine["protocol"] == PROTOCOL_VERSION and protocol_mismatch(mine, mine) is None
    newer = {**mine, "protocol": PROTOCOL_VERSION + 1}
    assert f"protocol {PROTOCOL_VERSION + 1}, this party protocol {PROTOCOL_VERSION}" in str(
        protocol_mismatch(mine, newer)
    )
    older = {k: v for k, v in mine.items() if k != "protocol"}  # a release before versions
    assert "a release before protocol versions" in str(protocol_mismatch(mine, older))


# ---- one process: the shared folder ----------------------------------------------------------
def _sides(root: Path, **options: float) -> tuple[Federation, Federation, Channel]:
    transport = FileTransport(root)
    parties = ("guest", "host")
    made = [Federation(transport, "job1", p, parties, interval=0.1, **options) for p in parties]
    return made[0], made[1], Channel(root, "job1-stage", transport)


def test_a_peers_failure_ends_a_wait_naming_it(tmp_path: Path) -> None:
    guest, host, channel = _sides(tmp_path)
    host.start()
    guest.start()
    try:
        guest.fail("ValueError: batch_size 0 must be at least 1")
        started = time.monotonic()
        with pytest.raises(PeerFailedError, match="party guest failed: ValueError: batch_size"):
            channel.endpoint("host").receive("guest", "gradient", timeout=60)
        assert time.monotonic() - started < 3
    finally:
        host.finish()


@pytest.mark.parametrize("end", ["finish", "fail"])
def test_a_wait_left_pending_in_a_sides_thread_ends_with_the_side(tmp_path: Path, end: str) -> None:
    """A message fetched ahead in a thread of the side (its context copied) that never comes
    must not keep the process alive until the receive timeout once the side has ended."""
    guest, _, channel = _sides(tmp_path)
    guest.start()
    ended: list[BaseException] = []

    def wait() -> None:
        try:
            channel.endpoint("guest").receive("host", "stop_decision", timeout=60)
        except BaseException as error:  # what ended the wait is the result
            ended.append(error)

    waiting = threading.Thread(target=watchers.in_context(wait), daemon=True)
    waiting.start()
    time.sleep(0.3)
    started = time.monotonic()
    guest.finish() if end == "finish" else guest.fail("ValueError: bad batch")
    waiting.join(timeout=10)
    assert not waiting.is_alive() and time.monotonic() - started < 3
    assert isinstance(ended[0], SideEndedError) and "guest ended here" in str(ended[0])
    # a wait begun after the side ended, outside such a thread, is not the side's any more
    with pytest.raises(MessageTimeoutError):
        channel.endpoint("guest").receive("host", "stop_decision", timeout=0.2)


def test_an_operators_abort_ends_both_sides(tmp_path: Path) -> None:
    guest, host, channel = _sides(tmp_path)
    with host.taking_part(), guest.taking_part():
        request_abort(host.transport, "job1", "host", "wrong data loaded")
        # both sides' watchers live in this process: the host's own (the request) or the
        # guest's (the host's record) may be the first to end the wait; each names the host
        # and the operator's reason
        named = r"party host (was aborted: )?aborted by an operator: wrong data"
        with pytest.raises(PeerFailedError, match=named):
            channel.endpoint("guest").receive("host", "gradient", timeout=60)
        with pytest.raises(PeerFailedError, match="aborted by an operator"):
            channel.endpoint("host").receive("guest", "gradient", timeout=60)


def test_a_silent_peer_is_down_then_ends_the_job_after_its_grace(tmp_path: Path) -> None:
    guest, host, channel = _sides(tmp_path, down_after=0.3, restart_grace=1.5)
    guest.start()
    guest._stop.set()  # the guest's process "vanished": its record stays, its heartbeat stops
    host.start()
    try:
        time.sleep(0.8)
        assert host.peers["guest"].down_since is not None  # reported down, still waiting
        assert host.failure is None
        with pytest.raises(PeerFailedError, match="guest is down: not heard from since"):
            channel.endpoint("host").receive("guest", "gradient", timeout=30)
    finally:
        host.finish()


def test_an_earlier_attempts_failure_waits_for_the_restart(tmp_path: Path) -> None:
    transport = FileTransport(tmp_path)
    old = Federation(transport, "job1", "guest", ("guest", "host"), interval=0.1)
    old.start()
    old.fail("killed")
    time.sleep(0.1)
    host = Federation(transport, "job1", "host", ("guest", "host"), interval=0.1)
    host.started = time.time() + 10  # host starts "much later" than the guest's failure
    host.start()
    try:
        time.sleep(0.4)
        assert host.failure is None  # an earlier attempt's failure is not a new one
        restarted = Federation(transport, "job1", "guest", ("guest", "host"), interval=0.1)
        restarted.start()
        channel = Channel(tmp_path, "job1-stage", transport)
        channel.endpoint("guest").send("host", "gradient", [1, 2])
        assert channel.endpoint("host").receive("guest", "gradient", timeout=5) == [1, 2]
        restarted.finish()
    finally:
        host.finish()
    with pytest.raises(MessageTimeoutError):  # with no federation active, timeouts decide
        channel.endpoint("host").receive("guest", "nothing", timeout=0.2)


def test_a_hospitals_failure_is_a_dropout_but_the_coordinators_ends_every_survivor(
    tmp_path: Path,
) -> None:
    """Horizontal LR tolerates dropouts: a failed hospital ends nobody's side (the protocol's
    threshold decides), while the coordinator's failure below threshold ends the survivors'."""
    transport = FileTransport(tmp_path)
    parties = ("coordinator", "hospital_a", "hospital_b")
    sides = {
        p: Federation(
            transport, "hlr", p, parties, interval=0.05, tolerated=parties[1:], tolerated_every=0.1
        )
        for p in parties
    }
    for side in sides.values():
        side.start()
    try:
        sides["hospital_a"].fail("injected failure before mask_input in round 2")
        time.sleep(0.5)
        for party in ("coordinator", "hospital_b"):
            sides[party].check()  # goes on
            shown = {row["party"]: row["state"] for row in sides[party].table()}
            assert shown["hospital_a"] == "failed (dropped: the job goes on)", shown
        sides["coordinator"].fail("round 3, stage mask_input: missing: hospital_a (failed)")
        time.sleep(0.5)
        with pytest.raises(PeerFailedError, match=r"party coordinator failed: round 3.*hospital_a"):
            sides["hospital_b"].check()
    finally:
        for side in sides.values():
            side.finish()


def test_a_hospital_hears_the_coordinator_every_interval_and_its_peers_seldom(
    tmp_path: Path,
) -> None:
    """Hospitals that may drop are only shown, so a hospital asks for their records every
    ``tolerated_every`` seconds; the coordinator, whose failure ends it, every interval."""
    asked: list[str] = []

    class Counting(FileTransport):
        def peer_status(self, run: str, peer: str) -> bytes | None:
            asked.append(peer)
            return super().peer_status(run, peer)

    parties = ("coordinator", "hospital_a", "hospital_b", "hospital_c")
    side = Federation(
        Counting(tmp_path), "hlr", "hospital_a", parties, tolerated=parties[1:],
        tolerated_every=10.0,
    )  # fmt: skip
    for _ in range(20):  # twenty intervals' polls, within one tolerated_every
        side.poll()
    assert asked.count("coordinator") == 20
    assert asked.count("hospital_b") == asked.count("hospital_c") == 1


def test_a_long_wait_refreshes_the_shown_state_from_the_waiting_thread(tmp_path: Path) -> None:
    transport = FileTransport(tmp_path)
    shown: list[tuple[str, str]] = []

    def show(side: Federation) -> None:
        shown.append((threading.current_thread().name, side.table()[0]["detail"]))

    host = Federation(
        transport, "job1", "host", ("guest", "host"), interval=0.1, show_every=0.2, show=show
    )
    guest = Federation(transport, "job1", "guest", ("guest", "host"), interval=0.1)
    guest.start()
    host.start()
    try:
        channel = Channel(tmp_path, "job1-stage", transport)
        with pytest.raises(MessageTimeoutError):
            channel.endpoint("host").receive("guest", "gradient", timeout=1.0)
    finally:
        host.finish()
        guest.finish()
    assert 2 <= len(shown) <= 6, shown  # every 0.2 s of a 1 s wait, not every poll
    assert {thread for thread, _ in shown} == {threading.current_thread().name}
    assert all("waiting for the 'gradient' message from guest" in doing for _, doing in shown)


def test_a_wait_outlasts_its_timeout_while_the_sender_is_alive_and_queued(tmp_path: Path) -> None:
    """A peer busy with an earlier job of its own (its side of this one still queued) is waited
    for past the receive timeout; once it runs this job, the timeout holds again."""
    transport = FileTransport(tmp_path)
    terms = digest({"job": "label_dp"})
    guest, host = (
        Federation(transport, "job1", p, ("guest", "host"), digest=terms, interval=0.05)
        for p in ("guest", "host")
    )
    guest.start("queued")
    host.start("running")
    channel = Channel(tmp_path, "job1-psi", transport)
    try:
        time.sleep(0.3)  # the host hears the guest once at least
        with watchers.bound(["job1-psi"], terms):
            send = watchers.in_context(channel.endpoint("guest").send)  # as the side's thread
            threading.Timer(1.5, send, ("host", "size", [7])).start()
            started = time.monotonic()
            assert channel.endpoint("host").receive("guest", "size", timeout=0.3) == [7]
            assert time.monotonic() - started >= 1.4
            guest.set_state("running")
            time.sleep(0.3)
            with pytest.raises(MessageTimeoutError):
                channel.endpoint("host").receive("guest", "next", timeout=0.3)
    finally:
        guest.finish()
        host.finish()


def test_every_message_of_an_agreed_job_is_bound_to_its_terms(tmp_path: Path) -> None:
    """A message carries the digest of the terms its sender agreed; a receiver that agreed to
    other terms (or a sender outside the agreement) is refused, naming the sender."""
    channel = Channel(tmp_path, "demo-vertical-nightly", FileTransport(tmp_path))
    agreed, other = digest({"epochs": 4}), digest({"epochs": 5})
    with watchers.bound(["demo-vertical-nightly"], agreed):
        record = channel.endpoint("guest").send("host", "gradient", [1, 2])
        assert channel.endpoint("host").receive("guest", "gradient") == [1, 2]
        channel.endpoint("guest").send("host", "gradient", [1, 2])  # a retry: the same bytes
    assert codec.bound_terms(channel.read_raw(record)) == agreed
    with watchers.bound(["demo-vertical-nightly"], other):
        channel.endpoint("guest").send("host", "update", [3])
        derived = Channel(tmp_path, "demo-vertical-nightly.pre", FileTransport(tmp_path))
        derived.endpoint("guest").send("host", "stats", [4])  # a stage's own derived job id
    with watchers.bound(["demo-vertical-nightly"], agreed):
        with pytest.raises(TermsBindingError, match=r"from guest to host .* bound to terms "):
            channel.endpoint("host").receive("guest", "update", timeout=1)
        with pytest.raises(TermsBindingError, match="guest runs the job under other terms"):
            derived.endpoint("host").receive("guest", "stats", timeout=1)
    channel.endpoint("guest").send("host", "unbound", [5])
    with (
        watchers.bound(["demo-vertical-nightly"], agreed),
        pytest.raises(TermsBindingError, match="bound to no terms"),
    ):
        channel.endpoint("host").receive("guest", "unbound", timeout=1)
    assert watchers.terms_of("demo-vertical-nightly") is None  # nothing outlives the block
    assert channel.endpoint("host").receive("guest", "update") == [3]  # unbound reader: as is


# ---- organisations as processes ---------------------------------------------------------------
@pytest.fixture(scope="module")
def orgs(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: None
) -> Iterator[dict[str, Org]]:
    """clinic (guest), lab (host) and the arbiter, each serving its endpoint."""
    source = tmp_path_factory.mktemp("source")
    small_main_job(source)
    made = prepare(tmp_path_factory.mktemp("orgs"), source=source, receive_timeout=120)
    for party in ("lab", "arbiter"):  # their services take the clinic's proposals
        _set_policy(made[party], 'accept_from = ["clinic"]')
    servers = serve_all(made.values(), _api())
    yield made
    stop_all(servers)  # each ends the sides its service started, which tell their peers


def _set_policy(org: Org, policy: str) -> None:
    """Replace the ``[policy]`` table of the party's configuration (read at each side's start)."""
    text = org.config.read_text().split("\n[policy]\n")[0]
    org.config.write_text(f"{text}\n[policy]\n{policy}\n")


def _status(org: Org, job: str) -> dict[str, object]:
    path = org.folder / "home" / "runs" / job / "status" / org.party
    return json.loads(path.read_text()) if path.exists() else {}


def _await_state(org: Org, job: str, states: tuple[str, ...], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _status(org, job).get("state") not in states:
        assert time.monotonic() < deadline, f"{org.party}: {_status(org, job)}"
        time.sleep(0.5)


def _privreg(org: Org, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """``privreg ARGS --config <the party's>`` as the party would type it in its folder."""
    command = [sys.executable, "-m", "privreg.cli", *args, "--config", str(org.config)]
    return subprocess.run(
        command, cwd=org.folder, env=env_of(org, _api()), text=True, capture_output=True, **kw
    )


def _job_start(org: Org, run: str) -> subprocess.Popen[str]:
    """``privreg job start jobs/demo.json --run RUN`` at ``org``: proposes, then runs its side."""
    return subprocess.Popen(
        [sys.executable, "-m", "privreg.cli", "job", "start", "jobs/demo.json",
         "--config", str(org.config), "--run", run],
        cwd=org.folder, env=env_of(org, _api()), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _api() -> dict[str, str]:
    """The session's test Prefect server, shared by every party process."""
    from prefect.settings import PREFECT_API_URL

    return {
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PREFECT_CLIENT_MAX_RETRIES": "8",
        **SMALL_KEYS,  # each party's own opt-in to the small job's 1024-bit keys
    }


def _run_everywhere(orgs: dict[str, Org], run: str) -> dict[str, tuple[float, int, str]]:
    """Every party's ``privreg party pipeline --run RUN``; per party: when it exited (monotonic),
    its exit status and its log."""
    api = _api()
    running: dict[str, tuple[subprocess.Popen, Path]] = {}
    for party, org in orgs.items():
        log = org.folder / f"{run}.log"
        with log.open("w") as stderr:
            args = ["--job-file", "jobs/demo.json", "--run", run]
            running[party] = (start(org, "pipeline", args, api, stderr=stderr), log)
    ended: dict[str, tuple[float, int, str]] = {}
    deadline = time.monotonic() + 300
    while len(ended) < len(running) and time.monotonic() < deadline:
        for party, (process, log) in running.items():
            if party not in ended and process.poll() is not None:
                ended[party] = (time.monotonic(), process.returncode, log.read_text())
        time.sleep(0.1)
    for process, _ in running.values():
        if process.poll() is None:
            process.kill()
    return ended


def test_a_job_file_differing_in_one_option_is_refused_everywhere_before_any_load(
    orgs: dict[str, Org],
) -> None:
    lab = orgs["lab"].folder / "jobs/demo.json"
    agreed = lab.read_text()
    job = json.loads(agreed)
    job["vertical"]["learning_rate"] = 0.3
    lab.write_text(json.dumps(job))
    try:
        ended = _run_everywhere(orgs, "terms")
    finally:
        lab.write_text(agreed)
    assert set(ended) == {"clinic", "lab", "arbiter"}
    for party, (_, status, log) in ended.items():
        assert status != 0, f"{party} ran a job whose terms differ"
        assert "job.vertical.learning_rate" in log and "0.3" in log and "0.15" in log, party
        assert "/load" not in log  # no stage line: nothing was loaded
    for party in ("clinic", "lab"):
        assert not list((orgs[party].folder / "var").rglob("*.duckdb")), party


def test_a_guest_failing_at_set_up_ends_every_peer_within_seconds(orgs: dict[str, Org]) -> None:
    clinic = orgs["clinic"].folder / "demo/clinic_guest.csv"
    clinic.unlink()  # the clinic's own copy of its source
    clinic.write_text("patient_id,x1\np1,0.5\n")  # no diagnosis column: the guest refuses
    try:
        ended = _run_everywhere(orgs, "failing")
    finally:
        clinic.unlink()
        shutil.copy(ROOT / "demo/clinic_guest.csv", clinic)
    assert {party: status != 0 for party, (_, status, _) in ended.items()} == {
        "clinic": True, "lab": True, "arbiter": True,
    }  # fmt: skip
    guest_exit = ended["clinic"][0]
    for party in ("lab", "arbiter"):
        seconds, _, log = ended[party]
        assert seconds - guest_exit < 15, f"{party}: {seconds - guest_exit:.1f} s\n{log[-3000:]}"
        assert "party clinic failed" in log and "diagnosis" in log, log[-2000:]


def test_a_policy_rule_refuses_the_job_at_every_party_naming_the_rule(
    orgs: dict[str, Org],
) -> None:
    _set_policy(orgs["lab"], 'accept_from = ["clinic"]\nmin_key_bits = 2048')
    try:
        ended = _run_everywhere(orgs, "policy")
    finally:
        _set_policy(orgs["lab"], 'accept_from = ["clinic"]')
    rule = "vertical.key_size 1024 is below policy.min_key_bits 2048"
    assert ended["lab"][1] != 0 and rule in ended["lab"][2]
    for party in ("clinic", "arbiter"):
        assert ended[party][1] != 0
        assert (
            f"party lab failed: PolicyRefusalError: lab refuses job demo: {rule}"
            in (ended[party][2])
        ), party


def test_a_proposed_run_starts_at_every_peer_and_waits_for_a_manual_approval(
    orgs: dict[str, Org],
) -> None:
    """The clinic proposes; the arbiter's service starts its side unattended; the lab's
    policy wants a person: its side pauses in its Prefect until approved through the API."""
    _set_policy(orgs["lab"], 'accept_from = ["clinic"]\napproval = "manual"')
    clinic = _job_start(orgs["clinic"], "approved")
    try:
        _await_state(orgs["lab"], "demo-approved", ("approval",), 240)
        arbiter = _status(orgs["arbiter"], "demo-approved").get("state")
        assert arbiter in ("queued", "agreeing", "running"), arbiter  # started unattended
        answer = _privreg(orgs["lab"], "job", "approve", "demo-approved", timeout=120)
        assert answer.returncode == 0, answer.stderr
        out, _ = clinic.communicate(timeout=300)
    finally:
        _set_policy(orgs["lab"], 'accept_from = ["clinic"]')
        if clinic.poll() is None:
            clinic.kill()
    assert clinic.returncode == 0, out[-3000:]
    for party in ("clinic", "lab", "arbiter"):  # a peer may still be promoting its model
        _await_state(orgs[party], "demo-approved", ("done",), 60)
    shown = _privreg(orgs["lab"], "job", "status", "demo-approved", timeout=60)
    assert shown.returncode == 0 and shown.stdout.count("done") == 3, shown.stdout


def test_a_scheduled_run_of_the_clinic_runs_at_every_party_with_no_action_there(
    orgs: dict[str, Org],
) -> None:
    """``privreg job schedule`` at the clinic serves a cron deployment of ``start_job``; one of
    its scheduled runs (made due now rather than at 02:00) proposes itself to the lab and the
    arbiter, whose services start their sides unattended, and the job is done everywhere."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Scheduled

    clinic = orgs["clinic"]
    command = [sys.executable, "-m", "privreg.cli", "job", "schedule", "jobs/demo.json",
               "--config", str(clinic.config), "--cron", "0 2 * * *"]  # fmt: skip
    env = env_of(clinic, {**_api(), "PREFECT_RUNNER_POLL_FREQUENCY": "1"})
    serving = subprocess.Popen(
        command, cwd=clinic.folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    deployment = client.read_deployment_by_name("start_job/clinic-demo")
                    break
                except Exception:  # not served yet
                    assert serving.poll() is None and time.monotonic() < deadline, "not served"
                    time.sleep(0.5)
            assert [s.schedule.cron for s in deployment.schedules] == ["0 2 * * *"]
            due = datetime.now(UTC).replace(microsecond=0)
            made = client.create_flow_run_from_deployment(
                deployment.id, state=Scheduled(scheduled_time=due)
            )
        job = f"demo-{due.strftime('%Y%m%dT%H%M%S')}"  # the run is named for its schedule
        for party in ("clinic", "lab", "arbiter"):
            _await_state(orgs[party], job, ("done",), 300)
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 60
            while (ran := client.read_flow_run(made.id)).state_type != StateType.COMPLETED:
                assert not ran.state.is_final() and time.monotonic() < deadline, ran.state
                time.sleep(0.5)
        for party in ("lab", "arbiter"):  # started by their services, on the clinic's word
            assert _status(orgs[party], job)["state"] == "done"
            started = orgs[party].folder / "home/runs" / job / "status" / f"{party}.flow_run"
            assert started.exists(), party
    finally:  # on SIGTERM the runner pauses the schedule first (slow on a busy test server)
        serving.terminate()
        try:
            serving.wait(timeout=180)
        except subprocess.TimeoutExpired:
            serving.kill()
            serving.wait()


def test_a_declined_run_ends_at_every_party_with_the_reason(orgs: dict[str, Org]) -> None:
    _set_policy(orgs["lab"], 'accept_from = ["clinic"]\napproval = "manual"')
    clinic = _job_start(orgs["clinic"], "declined")
    try:
        _await_state(orgs["lab"], "demo-declined", ("approval",), 240)
        no = _privreg(orgs["lab"], "job", "decline", "demo-declined", "--reason", "not tonight")
        assert no.returncode == 0, no.stderr
        out, _ = clinic.communicate(timeout=120)
    finally:
        _set_policy(orgs["lab"], 'accept_from = ["clinic"]')
        if clinic.poll() is None:
            clinic.kill()
    assert clinic.returncode != 0
    assert "lab declined the job proposed by clinic: not tonight" in out, out[-3000:]
    _await_state(orgs["arbiter"], "demo-declined", ("failed", "aborted"), 30)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_pool_workers_end_with_their_killed_parent() -> None:
    """A party's Paillier pool (gmpy2, or a large decryption) must not outlive its side: kill
    -9 of the process that started it ends every worker within 10 s (core.lifetime)."""
    code = (
        "import os, time\n"
        "from core.paillier.parallel import ProcessBackend\n"
        "pids = ProcessBackend(2).run(os.getpid, [(), (), (), ()])\n"
        "print(*sorted(set(pids)), flush=True)\n"
        "time.sleep(300)\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    try:
        workers = {int(pid) for pid in parent.stdout.readline().split()}  # type: ignore[union-attr]
        assert workers and all(_alive(pid) for pid in workers)
        workers |= descendants(parent.pid)  # the forkserver too
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive := [pid for pid in workers if _alive(pid)]:
            assert time.monotonic() < deadline, f"workers left running after 10 s: {alive}"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_killed_proposed_side_resumes_at_its_party_and_trains_the_uninterrupted_model(
    orgs: dict[str, Org], tmp_path: Path
) -> None:
    """The clinic proposes; kill -9 of the lab's side (started by its service) once its vertical
    stage has begun: it and every process it started are gone within 10 s (a Paillier
    pool's workers too: :func:`test_pool_workers_end_with_their_killed_parent`), and its peers
    wait.
    ``privreg job resume`` at the lab (whose peers' policies take no proposals from it)
    restarts that side, the lost run is marked Crashed in its Prefect, the job completes at
    every party, and the model equals a run on the same aligned rows that was never killed."""
    from helpers import vertical_slices
    from prefect.client.orchestration import get_client

    from flows.vertical_lr import vertical_lr

    clinic = _job_start(orgs["clinic"], "killed")
    resumed = None
    try:
        pid_file = orgs["lab"].folder / "home/runs/demo-killed/status/lab.flow_run"
        deadline = time.monotonic() + 240
        vertical = orgs["lab"].folder / "home/runs/demo-vertical-killed"  # its first message
        while not vertical.exists():
            assert clinic.poll() is None and time.monotonic() < deadline, "no vertical stage"
            time.sleep(0.02)
        lost, pid = pid_file.read_text().split()
        family = {int(pid), *descendants(int(pid))}
        os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive := [p for p in family if _alive(p)]:
            assert time.monotonic() < deadline, f"left running after 10 s: {alive}"
            time.sleep(0.2)
        assert clinic.poll() is None  # waiting for the lab within the restart grace
        resumed = _privreg(orgs["lab"], "job", "resume", "jobs/demo.json", "--run", "killed",
                           timeout=300)  # fmt: skip
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        out, _ = clinic.communicate(timeout=300)
    finally:
        if clinic.poll() is None:
            clinic.kill()
    assert clinic.returncode == 0, out[-3000:]
    for party in ("clinic", "lab", "arbiter"):
        _await_state(orgs[party], "demo-killed", ("done",), 60)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(lost).state.type.value == "CRASHED"
    # the same aligned rows, copied, trained in one uninterrupted local run
    job = read_job(orgs["clinic"].folder / "jobs/demo.json")
    killed, copies = [], []
    for role, org in (("guest", orgs["clinic"]), ("host", orgs["lab"])):
        table = job["parties"][role]["table"]
        table = {**table, "table": f"{table['table']}_aligned"}
        killed.append({**table, "database": str(org.folder / table["database"])})
        copies.append({**table, "database": str(tmp_path / Path(table["database"]).name)})
        shutil.copy(killed[-1]["database"], copies[-1]["database"])
    reference = vertical_lr(copies[0], copies[1:], workspace=str(tmp_path), **job["vertical"])
    assert vertical_slices("demo-vertical-killed", *killed) == vertical_slices(
        reference["job_id"], *copies
    )
