"""How a privreg process runs Prefect's temporary API server (the embedded default).

:func:`install`, run by every process that imports ``flows``, sets what Prefect 3.8.8 leaves to
the caller: the server dies with its process, waits longer to start and for its SQLite lock,
stops once it recorded this process's task runs, hears no heartbeats and sends no analytics.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
import time
import types
from collections import OrderedDict
from datetime import UTC, datetime, timedelta
from typing import Any

from privreg import prefect_sqlite

# several parties starting at once on one machine each run the server's migrations (a fresh
# start took ~13 s alone): more than Prefect's 20 s, unless the environment sets the setting
STARTUP_TIMEOUT = 120
_STARTUP_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
# a new SQLite connection's wait for the lock while it is set up (several sides connect at once;
# Prefect's 10 s printed "database is locked" retries); its writes then wait
# prefect_sqlite.BUSY_TIMEOUT_MS, not Prefect's 60 s
DATABASE_TIMEOUT = "60"
_DATABASE_SETTING = "PREFECT_SERVER_DATABASE_TIMEOUT"
# off unless set: a party's machine often cannot reach the internet, where each attempt logged
# an error
_ANALYTICS_SETTING = "PREFECT_SERVER_ANALYTICS_ENABLED"
RECORDING_GRACE = 10.0  # seconds a stopping server may take to record the last task runs
_HEARTBEAT_SETTINGS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")


def _popen_under_watch(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen`` of ``python -m MODULE ...`` run as ``python -m core.lifetime
    <this pid> -m privreg.prefect_sqlite MODULE ...``, so a SIGKILLed flow process leaves no
    server behind (Prefect cleans up only at a normal exit) and the server's SQLite writers do
    not stall a run for a minute."""
    if len(args) > 2 and args[0] == sys.executable and args[1] == "-m":
        module_argv = prefect_sqlite.server_command(args[2:])
        args = [sys.executable, "-m", "core.lifetime", str(os.getpid()), "-m", *module_argv]
    env = kwargs.get("env")
    if env is not None:  # the child must import core.lifetime from this installation
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        paths = [p for p in (root, env.get("PYTHONPATH", "")) if p]
        kwargs["env"] = {**env, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.Popen(args, **kwargs)


def _no_heartbeats() -> None:
    """No heartbeats unless the environment asks: they mark a dead process's runs crashed, but a
    temporary server dies with its process, and Prefect 3.8.8 waits out the heartbeat thread's
    one-second sleep as each flow run ends (up to a second per side flow, on the run's path)."""
    from prefect.settings import get_current_settings

    if not any(name in os.environ for name in _HEARTBEAT_SETTINGS):
        get_current_settings().flows.heartbeat_frequency = None


#: The timestamp of the last state this process emitted for each of its task runs, by id, in
#: the order they were emitted: what a stopping temporary server must have recorded first.
_EMITTED: OrderedDict[str, datetime] = OrderedDict()
_EMITTED_LOCK = threading.Lock()


def _remember_emitted() -> None:
    """Keep :data:`_EMITTED` as the task engine emits each state event (idempotent); states
    older than :data:`_RECENT_SECONDS` are dropped as new ones come."""
    from prefect import task_engine

    emit = task_engine.emit_task_run_state_change_event
    if getattr(emit, "_privreg_remembers", False):
        return

    signature = inspect.signature(emit)

    def remembering(*args: Any, **kwargs: Any) -> Any:
        event = emit(*args, **kwargs)
        called = signature.bind(*args, **kwargs).arguments
        key, stamp = str(called["task_run"].id), called["validated_state"].timestamp
        with _EMITTED_LOCK:
            _EMITTED[key] = stamp
            _EMITTED.move_to_end(key)
            recent = _recent()
            while _EMITTED and next(iter(_EMITTED.values())) < recent:
                _EMITTED.popitem(last=False)
        return event

    remembering._privreg_remembers = True  # type: ignore[attr-defined]
    task_engine.emit_task_run_state_change_event = remembering


def _await_recorded(api_url: str, grace: float = RECORDING_GRACE) -> None:
    """Wait, at most ``grace`` seconds, until the server holds every task run's last state
    this process emitted: the server records them from events, after they arrive, and one
    stopped meanwhile lost them (the last task of a run missing, or shown running forever)."""
    import httpx

    with _EMITTED_LOCK:
        recent = _recent()
        waiting = {key: stamp for key, stamp in _EMITTED.items() if stamp >= recent}
    deadline = time.monotonic() + grace
    with httpx.Client(base_url=api_url, timeout=grace) as client:
        while waiting and time.monotonic() < deadline:
            ids = list(waiting)
            try:
                for start in range(0, len(ids), _PAGE):
                    page = {"id": {"any_": ids[start : start + _PAGE]}}
                    body = {"task_runs": page, "limit": _PAGE}
                    runs = client.post("/task_runs/filter", json=body).raise_for_status().json()
                    for run in runs:
                        stamp = (run.get("state") or {}).get("timestamp")
                        if stamp and datetime.fromisoformat(stamp) >= waiting[run["id"]]:
                            del waiting[run["id"]]
            except (httpx.HTTPError, ValueError):  # a server already going: nothing to wait for
                return
            if waiting:
                time.sleep(0.05)


_PAGE = 200  # task runs per filter request (the API's largest page)
_RECENT_SECONDS = 300  # a state emitted longer ago than this is recorded (or never will be)


def _recent() -> datetime:
    return datetime.now(UTC) - timedelta(seconds=_RECENT_SECONDS)


def install() -> None:
    """Patch Prefect's temporary-server launcher (idempotent). With an API URL configured no
    temporary server starts, and its module (about 2.5 s to import) is not loaded."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return
    os.environ.setdefault(_DATABASE_SETTING, DATABASE_TIMEOUT)  # read by the server's process
    os.environ.setdefault(_ANALYTICS_SETTING, "false")  # likewise
    _no_heartbeats()
    from prefect.server.api import server

    if getattr(server.SubprocessASGIServer, "_privreg_watched", False):
        return
    server.subprocess = types.SimpleNamespace(  # only this module's view of subprocess
        **{name: getattr(subprocess, name) for name in dir(subprocess) if not name.startswith("__")}
    )
    server.subprocess.Popen = _popen_under_watch
    start = server.SubprocessASGIServer.start

    def start_with_patience(self: Any, timeout: int | None = None) -> None:
        if timeout is None and _STARTUP_SETTING not in os.environ:
            timeout = STARTUP_TIMEOUT
        _remember_emitted()  # what its stop waits to be recorded
        start(self, timeout)

    server.SubprocessASGIServer.start = start_with_patience
    stop = server.SubprocessASGIServer.stop

    def stop_once_recorded(self: Any) -> None:
        if self.server_process is not None:
            _await_recorded(self.api_url)
        stop(self)

    server.SubprocessASGIServer.stop = stop_once_recorded
    server.SubprocessASGIServer._privreg_watched = True
