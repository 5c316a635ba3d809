"""The organisation's Prefect server on SQLite against PostgreSQL (part of ``make
bench-federation``).

Twenty sides at once report to one server started as ``privreg party serve`` starts it
(:class:`privreg.org_prefect.OrgPrefect`): each side is its own process running a flow of a
side's shape (tasks one after the other, each logging), all started together, so their
``create_flow_run`` calls, state changes and log writes meet at the server. The same load runs
against the server on its default SQLite database and on PostgreSQL (a cluster made and
started by ``make prefect-postgres`` in a temporary folder, as the PostgreSQL user when run as
root, since PostgreSQL refuses root). Per database:

* wall time: the first side's start to the last side's end;
* ``create_flow_run`` stalls: calls that took over 5 s (timed in each side), and the slowest;
* lock / 503 errors: responses a side's client had to retry (503, Prefect's answer to SQLite's
  lock wait) plus "database is locked" lines in the server's log;
* sides that failed.

Lean on purpose (two cores here): one round of twenty sides per database.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from federation.party_config import PartyConfig  # noqa: E402
from privreg.org_prefect import ENV, OrgPrefect  # noqa: E402

STALL = 5.0
DB_URL = "PREFECT_SERVER_DATABASE_CONNECTION_URL"

#: One side: times its client's create_flow_run calls and counts the responses it retried,
#: runs a flow of ``argv[2]`` tasks, prints a JSON line.
SIDE = """
import json, logging, sys, time
from prefect import flow, get_run_logger, task
from prefect.client.orchestration._flow_runs.client import FlowRunAsyncClient, FlowRunClient

timings, retried = [], []

class Retries(logging.Handler):
    def emit(self, record):
        if "retryable" in record.getMessage():
            retried.append(record.getMessage()[:120])

client_log = logging.getLogger("prefect.client")
client_log.setLevel(logging.DEBUG)
client_log.addHandler(Retries())

def timed_sync(original):
    def create_flow_run(self, *args, **kwargs):
        began = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            timings.append(time.monotonic() - began)
    return create_flow_run

def timed_async(original):
    async def create_flow_run(self, *args, **kwargs):
        began = time.monotonic()
        try:
            return await original(self, *args, **kwargs)
        finally:
            timings.append(time.monotonic() - began)
    return create_flow_run

FlowRunClient.create_flow_run = timed_sync(FlowRunClient.create_flow_run)
FlowRunAsyncClient.create_flow_run = timed_async(FlowRunAsyncClient.create_flow_run)

@task
def step(index: int) -> int:
    get_run_logger().info("step %d of side %s", index, sys.argv[1])
    time.sleep(0.2)
    return index

@flow(name="bench-side")
def side(name: str, steps: int) -> int:
    get_run_logger().info("side %s begins", name)
    return sum(step(i) for i in range(steps))

ok = True
try:
    side(sys.argv[1], int(sys.argv[2]))
except Exception as error:
    ok = False
    print(repr(error)[:300], file=sys.stderr)
print(json.dumps({"ok": ok, "create_flow_run": timings, "retried": retried}))
"""


@dataclass(frozen=True)
class Load:
    """What one database gave under the twenty sides."""

    database: str
    wall: float
    stalls: int
    slowest: float
    errors: int
    failed: int


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def postgres(folder: Path):
    """A PostgreSQL cluster made and started by ``make prefect-postgres`` under ``folder``;
    yields its connection URL for Prefect, stops it afterwards."""
    data, port = folder / "postgres", _free_port()
    pg_bin = Path(shutil.which("pg_ctl") or "pg_ctl").resolve().parent
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses root: its own user runs it
        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        os.chmod(folder.parent, 0o711)  # a temporary folder is root's alone: let it pass
        as_user = ["runuser", "-u", "postgres", "--"]
    make = [*as_user, "make", "-s", "-C", str(ROOT), "prefect-postgres", f"PG_DATA={data}",
            f"PG_PORT={port}", f"PG_BIN={pg_bin}/"]  # fmt: skip
    subprocess.run(make, check=True, stdout=subprocess.DEVNULL)
    try:
        password = (folder / "postgres.password").read_text().strip()
        yield f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/prefect"
    finally:
        stop = [*as_user, str(pg_bin / "pg_ctl"), "--pgdata", str(data), "--mode", "fast", "stop"]
        subprocess.run(stop, check=False, stdout=subprocess.DEVNULL)


def twenty_sides(folder: Path, database: str, url: str | None, sides: int, steps: int) -> Load:
    """``sides`` side processes at once against a fresh organisation's server."""
    config = PartyConfig(party="lab", root=folder / "home", listen="", ca=Path(), cert=Path(),
                         key=Path())  # fmt: skip
    saved = dict(os.environ)
    os.environ.pop(ENV, None)
    if url:
        os.environ[DB_URL] = url
    try:
        server = OrgPrefect.for_party(config)
        server.wait_ready(say=lambda _line: None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        env = {**os.environ, ENV: server.api_url, "PREFECT_LOGGING_LEVEL": "WARNING"}
        env.pop(DB_URL, None)
        began = time.monotonic()
        running = [
            subprocess.Popen([sys.executable, "-c", SIDE, f"s{i}", str(steps)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for i in range(sides)
        ]  # fmt: skip
        reports = [json.loads((p.communicate()[0].strip() or "{}").splitlines()[-1])
                   for p in running]  # fmt: skip
        wall = time.monotonic() - began
    finally:
        server.stop()
    timings = [t for r in reports for t in r.get("create_flow_run", [])]
    locked = server.log.read_text(errors="replace").count("database is locked")
    return Load(
        database, wall, sum(t > STALL for t in timings), max(timings, default=0.0),
        sum(len(r.get("retried", [])) for r in reports) + locked,
        sum(not r.get("ok") for r in reports),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="tasks per side")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="privreg-bench-prefect-db-"))
    missing = ""
    try:
        rows = [twenty_sides(folder / "sqlite", "SQLite (default)", None, args.sides, args.steps)]
        (folder / "pg").mkdir()
        try:
            with postgres(folder / "pg") as url:
                rows.append(twenty_sides(folder / "postgres", "PostgreSQL", url, args.sides,
                                         args.steps))  # fmt: skip
        except (OSError, KeyError, subprocess.CalledProcessError) as error:
            missing = f"PostgreSQL not measured: make prefect-postgres failed ({error})"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nthe organisation's Prefect server under {args.sides} concurrent sides "
          f"({args.steps} tasks each, every side its own process)")  # fmt: skip
    print(f"{'database':<18} {'wall s':>7} {'create_flow_run > 5 s':>22} {'slowest s':>10} "
          f"{'lock/503 errors':>16} {'failed sides':>13}")  # fmt: skip
    for row in rows:
        print(f"{row.database:<18} {row.wall:>7.1f} {row.stalls:>22} {row.slowest:>10.1f} "
              f"{row.errors:>16} {row.failed:>13}")  # fmt: skip
    if missing:
        print(missing)


if __name__ == "__main__":
    main()
