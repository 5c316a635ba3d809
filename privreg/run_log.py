"""Where ``privreg run`` sends Prefect's log lines: a file under ``var/logs``, not the terminal.

The terminal gets one progress line per stage and, on an error, one line naming the error and
this file; the file keeps every log line and the traceback for whoever investigates.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)-7s %(name)s | %(message)s"


def log_path(folder: str | Path, job: str) -> Path:
    """``<folder>/<job>-<UTC time>.log``, a new file per run."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(folder) / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', job)}-{stamp}.log"


def _loggers() -> list[logging.Logger]:
    named = [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    return [logging.root, *named]


def _temporary_servers() -> list[object]:
    """The temporary Prefect servers of this process (started when no API URL is set)."""
    from prefect.server.api.server import SubprocessASGIServer

    return list(SubprocessASGIServer._instances.values())


@contextmanager
def logs_to_file(path: Path) -> Iterator[logging.Handler]:
    """Replace every terminal handler (Prefect's console, uvicorn's) with one file handler, and
    route Python warnings there too; everything is put back on exit."""
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # Prefect's handlers exist from here on: swap what it installed

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    swapped: list[tuple[logging.Logger, logging.Handler]] = []
    for logger in _loggers():
        for old in list(logger.handlers):
            if isinstance(old, logging.StreamHandler) and not isinstance(old, logging.FileHandler):
                logger.removeHandler(old)
                logger.addHandler(handler)
                swapped.append((logger, old))
    logging.captureWarnings(True)
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
        for logger, old in swapped:
            logger.removeHandler(handler)
            logger.addHandler(old)
        handler.close()
