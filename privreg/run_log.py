"""Where a command that runs flows (``privreg run``, ``privreg job start``, ``privreg party
pipeline``) sends Prefect's log lines: a file under ``var/logs``, not the terminal.

The terminal gets one progress line per stage and, on an error, one line naming the error and
this file; the file keeps every log line and the traceback for whoever investigates. Before
any flow starts, the Prefect database a temporary server would use is checked (it can be
created, it is not locked), so a bad one is one line at once, not a server's start-up
tracebacks for two minutes.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)-7s %(name)s | %(message)s"
LOCK_PATIENCE = 10.0
"""Seconds the check waits for a Prefect database another process is writing to."""


class RunFailedError(RuntimeError):
    """A run failed; the message is its one-line reason, ``log`` the file with the details."""

    def __init__(self, message: str, log: Path) -> None:
        super().__init__(message)
        self.log = log


class PrefectDatabaseError(RuntimeError):
    """The temporary Prefect server's database cannot be created, opened or written."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (KeyError's repr quotes dropped), with its kind when the
    message alone would not say what went wrong."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    text = " ".join(str(text).split())
    return text or type(error).__name__


#: A party's line for a stage it finished: ``clinic demo/psi (guest, 5.3 s): 470 shared rows``.
_STAGE_LINE = re.compile(r"\S+ \S+/\S+ \([^,()]+, [0-9.]+ s\): ")


class ProgressPrinter(logging.Handler):
    """A flow command's progress: each party's stage as it finishes, round x of y, elapsed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.started = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if _STAGE_LINE.match(message):  # a party's stage done (flows.pipeline_party)
            text = message
        elif message.startswith("progress: "):
            text = f"{getattr(record, 'flow_run_name', '')}: {message.removeprefix('progress: ')}"
        else:
            return
        print(f"[{time.monotonic() - self.started:7.1f} s] {text}", file=sys.stderr, flush=True)


@contextmanager
def flow_command(log: Path, what: str) -> Iterator[ProgressPrinter]:
    """The block (``what``: the command, for the log) runs flows: Prefect's lines go to
    ``log``, progress to the terminal, the Prefect database is checked first, and any error
    leaves as :class:`RunFailedError` (its one line and ``log``, which holds the traceback)."""
    printer = ProgressPrinter()
    runs = logging.getLogger("prefect.flow_runs")
    with logs_to_file(log):
        runs.addHandler(printer)
        try:
            check_prefect_database()
            yield printer
        except Exception as error:
            logging.getLogger("privreg").exception("%s failed", what)
            raise RunFailedError(one_line(error), log) from error
        finally:
            runs.removeHandler(printer)


def check_prefect_database(patience: float | None = None) -> None:
    """Refuse a temporary Prefect server's SQLite database that cannot be created or is held
    locked (past ``patience``, default :data:`LOCK_PATIENCE` seconds) by another process.
    With ``PREFECT_API_URL`` set, the server owns its database."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url
    if settings.api.url or url is None:
        return
    path = _sqlite_file(url.get_secret_value())
    if path is None:
        return
    hint = "set PREFECT_HOME to a writable folder, or PREFECT_API_URL to a running server"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PrefectDatabaseError(
            f"the Prefect database {path} cannot be created ({error.strerror}): {hint}"
        ) from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PrefectDatabaseError(f"the Prefect database {path} is not writable: {hint}")
    if path.exists():
        _check_writable(path, LOCK_PATIENCE if patience is None else patience, hint)


def _sqlite_file(url: str) -> Path | None:
    """The file of a SQLite connection URL (``sqlite+aiosqlite:///PATH``), else ``None``."""
    scheme, _, rest = url.partition(":///")
    if not scheme.startswith("sqlite") or not rest or rest.startswith(":memory:"):
        return None
    return Path(rest.split("?", 1)[0]).expanduser()


def _check_writable(path: Path, patience: float, hint: str) -> None:
    """Take the database's write lock and give it back: a lock held longer than ``patience``
    (a stuck writer) or a file that is no database is refused here."""
    try:
        with sqlite3.connect(path, timeout=patience) as db:
            db.execute("BEGIN IMMEDIATE")
            db.rollback()
    except sqlite3.OperationalError as error:
        if "locked" in str(error):
            raise PrefectDatabaseError(
                f"the Prefect database {path} is locked by another process (waited "
                f"{patience:g} s); stop that process or {hint}"
            ) from None
        raise PrefectDatabaseError(f"the Prefect database {path}: {error}; {hint}") from None
    except sqlite3.DatabaseError as error:
        raise PrefectDatabaseError(f"the Prefect database {path}: {error}; {hint}") from None


def log_path(folder: str | Path, job: str) -> Path:
    """``<folder>/<job>-<UTC time>.log``, a new file per run."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(folder) / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', job)}-{stamp}.log"


def _loggers() -> list[logging.Logger]:
    named = [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    return [logging.root, *named]


def _temporary_servers() -> list[object]:
    """The temporary Prefect servers of this process (started when no API URL is set)."""
    server = sys.modules.get("prefect.server.api.server")  # not loaded: none started (and
    # importing it only to learn that costs seconds)
    return [] if server is None else list(server.SubprocessASGIServer._instances.values())


@contextmanager
def logs_to_file(path: Path) -> Iterator[logging.Handler]:
    """Replace every terminal handler (Prefect's console, uvicorn's) with one file handler, and
    route Python warnings there too (those of Prefect's own import included); everything is
    put back on exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    warned = logging.getLogger("py.warnings")
    warned.addHandler(handler)
    propagated, warned.propagate = warned.propagate, False  # once in the file, not twice
    logging.captureWarnings(True)

    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # Prefect's handlers exist from here on: swap what it installed
    swapped: list[tuple[logging.Logger, logging.Handler]] = []
    for logger in _loggers():
        for old in list(logger.handlers):
            if isinstance(old, logging.StreamHandler) and not isinstance(old, logging.FileHandler):
                logger.removeHandler(old)
                logger.addHandler(handler)
                swapped.append((logger, old))
    servers = set(_temporary_servers())
    try:
        yield handler
    finally:
        started = set(_temporary_servers()) - servers
        if started:  # the run's last log lines reach the server before it stops
            from prefect.logging.handlers import APILogHandler

            APILogHandler().flush()
        for server in started:  # its "stopping" line: in the file
            server.stop()
        logging.captureWarnings(False)
        warned.removeHandler(handler)
        warned.propagate = propagated
        for logger, old in swapped:
            logger.removeHandler(handler)
            logger.addHandler(old)
        handler.close()
