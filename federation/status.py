"""A job as one federation-wide object: each party's state, heard by every peer within seconds.

Every party taking part in a job run keeps one *status record* of it (its state, what it is
doing or waiting for and since when, the job's terms digest, a heartbeat) in its own folder,
``runs/<job>/status/<party>``, rewritten about once a second while its side runs. Peers read
it through the transport: the shared folder in one process, the ``Status`` method of the
party's mTLS endpoint across organisations (served only to the parties the record names).

A :class:`Federation` runs beside one party's side of a job and, once a second:

* publishes this party's record (so its peers see it alive and what it waits for);
* reads every peer's record. A peer that *failed* or was *aborted* (``privreg job abort``,
  Ctrl-C, SIGTERM, an exception, a refusal) ends this side too, with an error naming that
  party and its reason: the channel's waits ask :meth:`Federation.check` between polls, so a
  peer's failure reaches every party in a few seconds instead of after ``receive_timeout``.
  A peer whose heartbeat stops (kill -9, machine down) is reported *down* after
  ``down_after`` seconds; its peers keep waiting for its restart (restart-and-resume from
  checkpoints keeps working) until ``restart_grace`` seconds, then end the job naming it.
  A record whose terms digest differs from this party's ends the job too, unless its party is
  tolerated (below): then it is dropped, as if it had failed (its messages are bound to other
  terms and refused anyway).
* A protocol that tolerates dropouts (horizontal LR, sparse LDA: any hospital may drop while
  at least the threshold remain) names its droppable parties ``tolerated``: their failure or
  absence is logged and shown but ends nobody's side; the protocol's own stage deadlines drop
  them, and its threshold decides whether the job goes on (a coordinator below threshold
  fails, and that failure, naming the missing parties, ends every survivor's side).
  Such a peer is heard every :data:`TOLERATED_EVERY` seconds, not every second: its state is
  only shown (and keeps a wait for it patient, well within ``down_after``), and among ten
  hospitals hearing each other every second was most of a round's CPU.

A failure record written more than :data:`STALE_AFTER` seconds before this side started is an
earlier attempt's: the peer counts as down until it restarts (it is not a new failure).

What a peer learns from a record: the job's parties, states, the kinds of messages waited
for and the reasons given for failures: nothing a message of the job would not tell it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from federation import watchers
from federation.channel import ChannelError, MessageKey, PeerUnreachableError, Transport

LIVE = ("queued", "agreeing", "approval", "running", "waiting")  # a heartbeat is expected
ENDED_BADLY = ("failed", "aborted")
STALE_AFTER = 5.0
INTERVAL = 1.0
TOLERATED_EVERY = 10.0
DOWN_AFTER = 30.0
RESTART_GRACE = 600.0

logger = logging.getLogger("privreg.federation")


class PeerFailedError(ChannelError):
    """Another party's side of the job ended (failed, aborted, down past its grace, or holds
    other terms): this side ends too, naming that party and its reason."""

    def __init__(self, job: str, party: str, reason: str) -> None:
        super().__init__(f"job {job}: party {party} {reason}")
        self.job, self.party, self.reason = job, party, reason


class SideEndedError(PeerFailedError):
    """This side of the job has ended (done or failed): a wait still pending in a thread it
    started (a message fetched ahead) ends here, so it does not keep the process alive until
    its receive timeout, waiting for a message that will not come."""


@dataclass(frozen=True)
class Proposal:
    """A peer asks this party to take part in a job run: the job file, read from this party's
    own folder (every organisation holds its own copy), and the run's name suffix."""

    job_file: str
    run: str = ""


class ProposalRefusedError(ChannelError):
    """A party's service refused a proposal (its standing policy, or the job file)."""


class AbortedHereError(PeerFailedError):
    """An operator of this party ended its side (``privreg job abort``)."""


@dataclass(frozen=True)
class PartyStatus:
    """One party's record of one job run, as it publishes it."""

    party: str
    job: str
    state: str
    parties: tuple[str, ...]
    digest: str = ""
    detail: str = ""
    reason: str = ""
    attempt: str = ""
    started: float = 0.0
    heartbeat: float = 0.0
    seq: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PartyStatus:
        fields = json.loads(data)
        fields["parties"] = tuple(fields.get("parties", ()))
        return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})


def status_parties(data: bytes) -> set[str]:
    """The parties a status record names (who may read it); empty if it does not parse."""
    try:
        return set(PartyStatus.from_bytes(data).parties)
    except (ValueError, TypeError):
        return set()


@dataclass
class PeerView:
    """What this party knows of one peer: its last record and when it was last heard from
    (this party's own clock, so machines' clocks need not agree)."""

    party: str
    status: PartyStatus | None = None
    heard: float | None = None
    down_since: float | None = None
    error: str = ""
    dropped: str = ""  # a tolerated peer's failure, as logged (once)
    observed: float | None = None  # when this party last asked for its record (monotonic)

    def line(self, now: float) -> str:
        if self.status is None:
            state = f"not started ({self.error})" if self.error else "not started"
        else:
            state = self.status.state + (f": {self.status.detail}" if self.status.detail else "")
            if self.status.reason:
                state += f" ({self.status.reason})"
        if self.down_since is not None:
            state = f"down since {_clock(self.down_since)}; last: {state}"
        heard = "never" if self.heard is None else f"{now - self.heard:.0f} s ago"
        return f"{self.party:<16} {state}  [heard {heard}]"

    def judge_silence(self, now: float, down_after: float = DOWN_AFTER) -> None:
        """Mark the peer down as its own peers would: a live record not heard from for more
        than ``down_after`` seconds (``privreg job status`` reads it once, without a
        :class:`Federation`, and must say "down" when the peers do)."""
        live = self.status is not None and self.status.state in LIVE
        if live and self.heard is not None and silent_too_long(self.heard, now, down_after):
            self.down_since = self.heard
        else:
            self.down_since = None

    def as_dict(self, now: float) -> dict[str, object]:
        """The view for scripts (``privreg job status --json``): times as Unix seconds."""
        status = self.status
        return {
            "party": self.party,
            "state": status.state if status else "not started",
            "detail": status.detail if status else "",
            "reason": status.reason if status else "",
            "heard": self.heard,
            "heard_seconds_ago": None if self.heard is None else round(now - self.heard, 1),
            "down": self.down_since is not None,
            "down_since": self.down_since,
            "error": self.error,
        }


def silent_too_long(heard: float, now: float, down_after: float = DOWN_AFTER) -> bool:
    """The one rule for "down": nothing new heard from a party for more than ``down_after``
    seconds (a live side rewrites its record every :data:`INTERVAL`)."""
    return now - heard > down_after


def _clock(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds))


@dataclass
class Federation:
    """One party's side of one job run, among its peers (see the module docstring)."""

    transport: Transport
    job: str
    party: str
    parties: tuple[str, ...]
    digest: str = ""
    interval: float = INTERVAL
    down_after: float = DOWN_AFTER
    restart_grace: float = RESTART_GRACE
    log: logging.Logger | logging.LoggerAdapter = logger  # the flow run's logger, in a flow
    show: Callable[[Federation], None] | None = None  # e.g. the job-status artifact
    show_every: float = 10.0
    tolerated: tuple[str, ...] = ()  # peers whose failure is a dropout the protocol survives
    tolerated_every: float = TOLERATED_EVERY  # how often a tolerated peer is heard
    state: str = "queued"
    detail: str = ""
    peers: dict[str, PeerView] = field(default_factory=dict)
    failure: PeerFailedError | None = None
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.parties = tuple(sorted(set(self.parties) | {self.party}))
        self.peers = {p: PeerView(p) for p in self.parties if p != self.party}
        self.attempt = secrets.token_hex(8)
        self._seq = 0
        self._ended = False
        self._waits: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = time.monotonic()

    # ---- this party's own record ------------------------------------------------------------
    def start(self, state: str = "running") -> Federation:
        """Publish this side's record, start hearing peers, and let the channel consult us."""
        self._clear_stale_abort()
        self.set_state(state)
        context = contextvars.copy_context()  # the flow run's context, for its logger
        self._thread = threading.Thread(
            target=context.run, args=(self._loop,), name=f"federation-{self.job}", daemon=True
        )
        self._thread.start()
        watchers.register(self)
        return self

    def set_state(self, state: str, detail: str = "", reason: str = "") -> None:
        with self._lock:
            self.state, self.detail = state, detail
            self._publish(reason)

    def fail(self, reason: str, state: str = "failed") -> None:
        """Tell every peer this side ended and why (before the process exits)."""
        self._end()
        with self._lock:
            self.state, self.detail = state, ""
            self._publish(reason)

    def finish(self) -> None:
        self._end()
        with self._lock:
            self.state, self.detail = "done", ""
            self._publish("")

    def _end(self) -> None:
        """Stop hearing peers, and end the waits still pending in this side's threads (they
        call :meth:`check` from a copy of the side's context, which still lists it)."""
        self._stop.set()
        self._ended = True
        watchers.unregister(self)

    @contextlib.contextmanager
    def taking_part(self) -> Iterator[Federation]:
        """The block is this party's side: started, then done, or failed with its reason."""
        if self._thread is None:
            self.start()
        else:
            self.set_state("running")
        try:
            yield self
        except BaseException as error:
            self.fail(*describe_exit(error))
            raise
        self.finish()

    def _publish(self, reason: str) -> None:
        self._seq += 1
        record = PartyStatus(
            self.party, self.job, self.state, self.parties, self.digest,
            self._current_detail(), reason, self.attempt, self.started, time.time(), self._seq,
        )  # fmt: skip
        self.transport.publish_status(self.job, self.party, record.to_bytes())

    def _current_detail(self) -> str:
        if self._waits and self.state in ("running", "waiting"):
            return next(iter(self._waits.values()))
        return self.detail

    @contextlib.contextmanager
    def waiting(self, key: MessageKey) -> Iterator[None]:
        """Show "waiting for the <kind> from <sender> since <time>" while a receive waits."""
        if key.sender not in self.peers or self.state not in ("running", "waiting"):
            yield
            return
        token = id(key) ^ threading.get_ident()
        with self._lock:
            self._waits[token] = (
                f"waiting for the {key.kind!r} message from {key.sender} "
                f"(job {key.run}, round {key.round}) since {_clock(time.time())}"
            )
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(token, None)

    def patient(self, key: MessageKey) -> bool:
        """A message of this job from a peer that is alive (heard within ``down_after``) and
        still ``queued`` for this job (each party runs its jobs in the job file's order, so a
        peer may be busy with an earlier one for longer than a receive timeout) is worth
        waiting for past the timeout; anything else is judged by the timeout as before."""
        view = self.peers.get(key.sender)
        if view is None or view.status is None or view.heard is None or not self.digest:
            return False
        if watchers.terms_of(key.run) != self.digest:
            return False  # not a message of this job
        alive = time.time() - view.heard < self.down_after
        return alive and view.status.state in ("queued", "agreeing", "approval")

    # ---- peers ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the job's failure, if any. Called by the waiting thread between its polls,
        which also refreshes :attr:`show` (at most every :attr:`show_every` seconds) while a
        wait lasts: the waiting thread is the run's own, unlike the listening thread."""
        if self.failure is not None:
            raise self.failure
        if self._ended:
            raise SideEndedError(self.job, self.party, "ended here: its pending waits end")
        if self.show is not None and self._waits:
            now = time.monotonic()
            if now - self._shown >= self.show_every:
                self._shown = now
                try:
                    self.show(self)
                except Exception as error:  # a view, never a reason to end the side
                    self.log.debug("job %s: status not shown: %s", self.job, error)

    def check_every(self) -> float:
        """As often as the listener hears peers, and as the shown state refreshes."""
        return min(self.interval, self.show_every) if self.show else self.interval

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as error:  # hearing peers must never kill the party's side
                self.log.warning("job %s: could not hear peers: %s", self.job, error)

    def poll(self) -> None:
        """One heartbeat and one look at every peer (the thread calls this every interval)."""
        with self._lock:
            if self.state in LIVE:
                self._publish("")
        for view in self.peers.values():
            if self._due(view):
                self._observe(view)
        if (request := self._abort_request()) is not None and self.failure is None:
            self.failure = AbortedHereError(
                self.job, self.party, f"aborted by an operator: {request}"
            )

    def _due(self, view: PeerView) -> bool:
        """Every peer each interval, but a tolerated one every :attr:`tolerated_every`."""
        if view.party not in self.tolerated or view.observed is None:
            return True
        return time.monotonic() - view.observed >= self.tolerated_every

    def _observe(self, view: PeerView) -> None:
        view.observed = time.monotonic()
        now = time.time()
        try:
            data = self.transport.peer_status(self.job, view.party)
            status = None if data is None else PartyStatus.from_bytes(data)
            view.error = ""
        except (PeerUnreachableError, ChannelError, ValueError) as error:
            status, view.error = view.status, str(error)
        if status is not None and (
            view.status is None
            or (status.attempt, status.seq) != (view.status.attempt, view.status.seq)
        ):
            view.heard = now  # a new record: the peer is alive (or just restarted)
        view.status = status
        self._judge(view, now)

    def _judge(self, view: PeerView, now: float) -> None:
        status = view.status
        if status is None:
            return  # not started yet: the receive timeouts decide how long to wait
        if status.digest and self.digest and status.digest != self.digest:
            self._fail_for(view.party, "holds other terms for this job (its job file differs)")
            return
        if status.state in ENDED_BADLY and status.heartbeat >= self.started - STALE_AFTER:
            what = "was aborted" if status.state == "aborted" else "failed"
            self._fail_for(view.party, f"{what}: {status.reason or 'no reason given'}")
            return
        silent_since = view.heard if view.heard is not None else self.started
        earlier_attempt = status.state in ENDED_BADLY  # failed before we started: may restart
        if (status.state in LIVE or earlier_attempt) and silent_too_long(
            silent_since, now, self.down_after
        ):
            if view.down_since is None:
                view.down_since = silent_since
                self.log.warning(
                    "job %s: party %s is down: not heard from since %s (%s); waiting up to "
                    "%.0f s for its restart", self.job, view.party, _clock(silent_since),
                    status.reason or status.detail or status.state, self.restart_grace,
                )  # fmt: skip
            if now - silent_since > self.restart_grace:
                self._fail_for(
                    view.party,
                    f"is down: not heard from since {_clock(silent_since)}, past the job's "
                    f"restart grace of {self.restart_grace:.0f} s",
                )
        elif view.down_since is not None:
            self.log.warning("job %s: party %s is back (%s)", self.job, view.party, status.state)
            view.down_since = None

    def _fail_for(self, party: str, reason: str) -> None:
        if party in self.tolerated:  # a dropout, whatever the reason (other terms too)
            view = self.peers[party]
            if not view.dropped:
                view.dropped = reason
                self.log.warning(
                    "job %s: party %s %s; the job goes on without it while the protocol's "
                    "threshold holds", self.job, party, reason,
                )  # fmt: skip
            return
        if self.failure is None:
            self.failure = PeerFailedError(self.job, party, reason)
            self.log.error("%s", self.failure)

    # ---- an operator's abort (``privreg job abort``) ----------------------------------------
    def _abort_request(self) -> str | None:
        return read_abort_request(self.transport, self.job, self.party)

    def _clear_stale_abort(self) -> None:
        path = abort_path(self.transport, self.job, self.party)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def table(self) -> list[dict[str, str]]:
        """Every party's state, for the Prefect artifact and ``privreg job status``."""
        now = time.time()
        rows = [{"party": self.party, "state": self.state, "detail": self._current_detail(),
                 "heard": "this party"}]  # fmt: skip
        for view in self.peers.values():
            status = view.status
            rows.append({
                "party": view.party,
                "state": ("DOWN " if view.down_since else "")
                + (status.state if status else "not started")
                + (" (dropped: the job goes on)" if view.dropped else ""),
                "detail": (status.reason or status.detail) if status else view.error,
                "heard": "never" if view.heard is None else f"{now - view.heard:.0f} s ago",
            })  # fmt: skip
        return rows


def describe_exit(error: BaseException) -> tuple[str, str]:
    """(reason, state) a party publishes when its side ends with ``error``."""
    if isinstance(error, AbortedHereError):
        return error.reason, "aborted"
    if isinstance(error, PeerFailedError):
        return f"stopped because party {error.party} {error.reason}", "failed"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C or SIGTERM)", "aborted"
    if isinstance(error, SystemExit):
        return f"exited ({error.code})", "aborted"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500], "failed"


def beside_status(transport: Transport, job: str, party: str, what: str) -> Path:
    """A local file kept beside a party's status record (``abort``, ``flow_run``): never
    served to peers."""
    status = transport.store().status_path(job, party)
    return status.with_name(f"{status.name}.{what}")


def abort_path(transport: Transport, job: str, party: str) -> Path:
    return beside_status(transport, job, party, "abort")


def request_abort(transport: Transport, job: str, party: str, reason: str) -> PartyStatus:
    """``privreg job abort``: this party's side ends with ``reason``, and so every peer's.

    A running side sees the request within a second and ends itself; the record is rewritten
    here too, so peers hear it even when no side of this party is running."""
    path = abort_path(transport, job, party)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reason)
    data = transport.store().read_status(job, party)
    if data is None:
        raise ChannelError(f"party {party} has no status for job {job}: it never took part")
    old = PartyStatus.from_bytes(data)
    record = replace(
        old, state="aborted", reason=f"aborted by an operator: {reason}", detail="",
        heartbeat=time.time(), seq=old.seq + 1,
    )  # fmt: skip
    transport.publish_status(job, party, record.to_bytes())
    return record


def read_abort_request(transport: Transport, job: str, party: str) -> str | None:
    try:
        return abort_path(transport, job, party).read_text()
    except FileNotFoundError:
        return None
