"""The Prefect servers privreg starts wait seconds, not a minute, for SQLite's write lock, and
their writes wait for it rather than fail at once (:mod:`privreg.prefect_sqlite`); both
launchers start them that way. Flow runs send a temporary server no heartbeats, and it sends
no analytics (:mod:`flows.runtime`)."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prefect.server.database.configurations import AioSqliteConfiguration

from flows import runtime
from privreg import prefect_sqlite


def _connection_waits(database: Path) -> tuple[int, float]:
    """(busy_timeout in ms, seconds an insert waited) for a connection of Prefect's server
    to ``database`` while another connection holds the write lock."""
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("PRAGMA journal_mode = WAL")  # as Prefect keeps its database
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")

    async def wait_for_lock() -> tuple[int, float]:
        config = AioSqliteConfiguration(f"sqlite+aiosqlite:///{database}")
        engine = await config.engine()
        try:
            async with engine.connect() as con:
                timeout = (await con.exec_driver_sql("PRAGMA busy_timeout")).scalar_one()
                began = time.monotonic()
                with pytest.raises(Exception, match="database is locked"):
                    await con.exec_driver_sql("INSERT INTO t VALUES (1)")
                return int(timeout), time.monotonic() - began
        finally:
            await engine.dispose()

    try:
        return asyncio.run(wait_for_lock())
    finally:
        holder.rollback()
        holder.close()


def test_a_server_connection_gives_up_on_a_held_lock_after_the_short_wait(tmp_path: Path) -> None:
    prefect_sqlite.patch()
    prefect_sqlite.patch()  # idempotent: one wrapper, not two
    recorder = logging.getLogger(prefect_sqlite.RECORDER_LOGGER)
    assert sum(isinstance(f, prefect_sqlite.RetriedFlush) for f in recorder.filters) == 1
    timeout, waited = _connection_waits(tmp_path / "prefect.db")
    assert timeout == prefect_sqlite.BUSY_TIMEOUT_MS
    assert prefect_sqlite.BUSY_TIMEOUT_MS / 1000 - 0.5 <= waited < 30  # Prefect's own: 60 s


def _write_after_a_peer_committed(database: Path) -> tuple[bool, float]:
    """(whether it committed, seconds it took) for a transaction of Prefect's server that reads
    and then writes while another connection holds the write lock, with a row written, for
    0.3 s: Prefect's DEFERRED begin is refused at once (its snapshot went stale)."""
    holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    holder.execute("PRAGMA journal_mode = WAL")
    holder.execute("CREATE TABLE t (x INTEGER)")

    async def read_then_write() -> tuple[bool, float]:
        config = AioSqliteConfiguration(f"sqlite+aiosqlite:///{database}")
        engine = await config.engine()
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("INSERT INTO t VALUES (1)")
        releaser = threading.Timer(0.3, holder.execute, ("COMMIT",))
        releaser.start()
        began = time.monotonic()
        try:
            session = await config.session(engine)
            async with session, config.begin_transaction(session):
                await session.execute(sa.text("SELECT count(*) FROM t"))
                await session.execute(sa.text("INSERT INTO t VALUES (2)"))
            return True, time.monotonic() - began
        except sa.exc.OperationalError as error:
            assert "database is locked" in str(error)
            return False, time.monotonic() - began
        finally:
            releaser.join()
            await engine.dispose()

    try:
        return asyncio.run(read_then_write())
    finally:
        holder.close()


def test_a_server_write_waits_for_the_lock_instead_of_a_503(tmp_path: Path) -> None:
    prefect_sqlite.patch()
    committed, took = _write_after_a_peer_committed(tmp_path / "prefect.db")
    assert committed and 0.25 <= took < prefect_sqlite.BUSY_TIMEOUT_MS / 1000


def _flush_error(dropped: int, error: Exception) -> logging.LogRecord:
    try:
        raise error
    except Exception:
        return logging.LogRecord(
            prefect_sqlite.RECORDER_LOGGER, logging.ERROR, __file__, 1,
            "Error flushing %d events (%d to retry, %d dropped)", (2, 2 - dropped, dropped),
            sys.exc_info(),
        )  # fmt: skip


def test_a_flush_retried_after_a_locked_database_is_one_warning_line() -> None:
    retried = _flush_error(0, sqlite3.OperationalError("database is locked"))
    assert prefect_sqlite.RetriedFlush().filter(retried)
    assert (retried.levelno, retried.exc_info) == (logging.WARNING, None)
    assert retried.getMessage() == (
        "Error flushing 2 events (2 to retry, 0 dropped): SQLite's lock was busy; retried"
    )
    for kept in (  # events dropped, or another failure: Prefect's error as it logs it
        _flush_error(1, sqlite3.OperationalError("database is locked")),
        _flush_error(0, ValueError("bad event")),
    ):
        assert prefect_sqlite.RetriedFlush().filter(kept)
        assert kept.levelno == logging.ERROR and kept.exc_info is not None


def test_the_temporary_server_is_started_through_the_short_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[list[str]] = []

    def record(args: list[str], **_kwargs: Any) -> None:
        started.append(args)

    monkeypatch.setattr(runtime.subprocess, "Popen", record)
    runtime._popen_under_watch([sys.executable, "-m", "uvicorn", "--factory", "app:make"])
    (command,) = started
    assert command[:3] == [sys.executable, "-m", "core.lifetime"]
    assert command[4:] == ["-m", "privreg.prefect_sqlite", "uvicorn", "--factory", "app:make"]


def test_the_module_runs_the_named_module_as_main(tmp_path: Path) -> None:
    script = tmp_path / "shout.py"
    script.write_text("import sys\nprint('main', sys.argv[1:])\n")
    out = subprocess.run(
        [sys.executable, "-m", "privreg.prefect_sqlite", "shout", "a", "b"],
        env={"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[1]}"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "main ['a', 'b']"


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({}, "None false"),  # the temporary server: nobody hears either
        ({"PREFECT_API_URL": "http://127.0.0.1:9/api"}, "180 None"),  # a server: Prefect's way
        ({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60"}, "60 false"),  # asked for
    ],
)
def test_a_temporary_server_hears_no_heartbeats_and_sends_no_analytics(
    setting: dict[str, str], expected: str
) -> None:
    """Prefect waits out its heartbeat thread's one-second sleep as each flow run ends: up to
    a second per side flow and per job of a local run, for heartbeats nobody hears. And a
    party's machine that cannot reach the internet logged an error for each analytics call."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PREFECT_API_URL", runtime._ANALYTICS_SETTING, *runtime._HEARTBEAT_SETTINGS)
    }
    code = "import os, flows; from prefect.settings import get_current_settings as s; "
    code += (
        "print(s().flows.heartbeat_frequency, os.environ.get('PREFECT_SERVER_ANALYTICS_ENABLED'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **setting, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1] == expected


@pytest.mark.usefixtures("prefect_server")
def test_a_stopping_temporary_server_first_records_every_state_this_process_emitted() -> None:
    """A server stopped while events of this process were still on their way lost them (the
    run's last task missing, or shown running forever); the stop waits until the server holds
    each task run's last state this process emitted, and no longer."""
    from datetime import UTC, datetime, timedelta

    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    since, release, running = datetime.now(UTC), threading.Event(), threading.Event()
    runtime._remember_emitted()  # as a temporary server's start does
    with runtime._EMITTED_LOCK:  # a state emitted an hour ago: dropped once the next comes
        runtime._EMITTED["an-old-run"] = since - timedelta(hours=1)
        runtime._EMITTED.move_to_end("an-old-run", last=False)

    @task
    def blocked() -> None:
        running.set()
        release.wait(30)

    @flow
    def one_task() -> None:
        blocked()

    worker = threading.Thread(target=one_task)
    worker.start()
    assert running.wait(30)
    began = time.monotonic()
    runtime._await_recorded(PREFECT_API_URL.value(), grace=20.0)  # until it is recorded running
    assert time.monotonic() - began < 20.0
    with get_client(sync_client=True) as client:
        (run,) = client.read_task_runs(flow_run_filter=_started_since(since))
    assert run.state is not None and run.state.is_running()
    assert "an-old-run" not in runtime._EMITTED
    release.set()
    worker.join(30)
    runtime._await_recorded(PREFECT_API_URL.value(), grace=20.0)
    with get_client(sync_client=True) as client:
        (run,) = client.read_task_runs(flow_run_filter=_started_since(since))
    assert run.state is not None and run.state.is_completed()  # not read again: recorded
    # a state the server does not hold (a later one, or an unknown run): waits the whole grace
    with runtime._EMITTED_LOCK:
        runtime._EMITTED[str(run.id)] = datetime.now(UTC) + timedelta(days=1)
    began = time.monotonic()
    runtime._await_recorded(PREFECT_API_URL.value(), grace=1.0)
    assert time.monotonic() - began >= 1.0
    with runtime._EMITTED_LOCK:
        runtime._EMITTED.pop(str(run.id))


def _started_since(since: Any) -> Any:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    return FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since))
