"""Run a Prefect server whose SQLite writers give up on a held lock after seconds, not a minute.

``python -m privreg.prefect_sqlite MODULE ARGS...`` runs ``MODULE`` (``uvicorn`` for the
temporary server, ``prefect`` for ``prefect server start``) as ``__main__`` with two changes:
every SQLite connection of Prefect's server waits :data:`BUSY_TIMEOUT_MS` for the write lock
instead of the 60 s Prefect 3.8.8 sets, and every transaction it opens to write takes that
lock at BEGIN. PostgreSQL is untouched.

Why: in a local run (every party's side reporting to one temporary server) the server's writers
sometimes wait on each other until one of them times out: a flow-run state change holds its
``BEGIN IMMEDIATE`` transaction while the task-run recorder's insert waits for the lock, and
neither moves until that insert gives up. With 60 s, ``make demo`` stalled 60-130 s in 8 of 20
runs here; with 5 s such a wait ends in 5 s, and nothing is lost: the recorder keeps the
events to retry, and a client retries an API call answered 503. Such a retried flush is
logged as one warning line (:class:`RetriedFlush`), not Prefect's error with its traceback.

Why the second: Prefect begins most write transactions DEFERRED, and SQLite refuses such a
transaction at once when another connection writes first; the API answered 503 and the client
slept about 2 s. Three sides of a local run starting their flows at once began 0.2-0.7 s,
2-2.7 s and 6-10 s after their parent (client logs: "retryable status code 503"); with the
lock taken at BEGIN, all three within 0.5-1.1 s.
"""

from __future__ import annotations

import logging
import runpy
import sys
from typing import Any

BUSY_TIMEOUT_MS = 5000
RECORDER_LOGGER = "prefect.server.services.task_run_recorder"


class RetriedFlush(logging.Filter):
    """The task-run recorder's "Error flushing N events (N to retry, 0 dropped)" after a
    locked database as one warning line without the traceback: its events are kept and
    written at the next flush. A flush that dropped events, or failed otherwise, is left as
    Prefect logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if (
            record.levelno == logging.ERROR
            and message.startswith("Error flushing")
            and message.endswith(" 0 dropped)")
            and "database is locked" in str(error)
        ):
            record.msg, record.args = f"{message}: SQLite's lock was busy; retried", None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def patch() -> None:
    """Set :data:`BUSY_TIMEOUT_MS` on each of the server's SQLite connections, after Prefect's
    own set-up of the connection (idempotent)."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    setup = AioSqliteConfiguration.setup_sqlite
    if getattr(setup, "_privreg_busy_timeout", False):
        return
    logging.getLogger(RECORDER_LOGGER).addFilter(RetriedFlush())

    def setup_with_short_wait(self: Any, conn: Any, record: Any) -> None:
        setup(self, conn, record)
        cursor = conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS};")
        cursor.close()

    setup_with_short_wait._privreg_busy_timeout = True  # type: ignore[attr-defined]
    AioSqliteConfiguration.setup_sqlite = setup_with_short_wait  # type: ignore[method-assign]
    _writes_take_the_lock_first()


def _writes_take_the_lock_first() -> None:
    """Every transaction Prefect opens for a write begins IMMEDIATE (takes the write lock, or
    waits for it, at BEGIN). Prefect 3.8.8 begins most of them DEFERRED: such a transaction
    reads, then tries to write while another connection writes, and SQLite refuses it at once
    (SQLITE_BUSY without waiting: a reader promoted to writer could deadlock) -- the API
    answers 503 and the client sleeps about 2 s before it retries."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    begin = AioSqliteConfiguration.begin_transaction
    if getattr(begin, "_privreg_immediate", False):
        return

    def begin_immediate(self: Any, session: Any, with_for_update: bool = False) -> Any:
        return begin(self, session, with_for_update=True)

    begin_immediate._privreg_immediate = True  # type: ignore[attr-defined]
    AioSqliteConfiguration.begin_transaction = begin_immediate  # type: ignore[method-assign]


def server_command(module_argv: list[str]) -> list[str]:
    """``MODULE ARGS...`` as the module arguments that run it through this one."""
    return [__name__, *module_argv]


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m privreg.prefect_sqlite MODULE [ARGS...]")
    patch()
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
