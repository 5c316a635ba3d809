"""Organisations on loopback, for the demos, the multi-process tests and the network benchmark.

Each organisation gets its own folder ``<root>/<party>/`` holding its certificate and key (from
one demo CA), its ``party.toml`` (its own message folder ``home/``, its listening port, its
peers' addresses) and whatever database it is given. Processes started here get that folder as
working directory, their own Prefect home, and no ``PRIVREG_*`` variable of the caller: they
know only what their configuration names.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from federation import certs

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "privreg.cli", "party"]


@dataclass(frozen=True)
class Org:
    party: str
    folder: Path
    config: Path
    port: int

    @property
    def messages(self) -> Path:
        """The party's own message folder (what it sent and what it received)."""
        return self.folder / "home" / "runs"


_HELD: list[IO[str]] = []  # this process's port reservations, released when it exits


def free_port() -> int:
    """A loopback port that is free now and that no other caller of this function, in any
    process, is handed while this process lives.

    The port is only written into a configuration here and bound later by a party's process,
    so two test workers asking the OS at the same moment could be given the same one; a lock
    file per port, held by the asking process, keeps their choices apart."""
    folder = Path(tempfile.gettempdir()) / f"privreg-ports-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        claim = open(folder / str(port), "a")  # noqa: SIM115 (held until the process exits)
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another live process (or this one) was handed it
            claim.close()
            continue
        _HELD.append(claim)
        return port
    raise RuntimeError("no free loopback port found in 100 tries")


def make_orgs(
    root: Path,
    parties: list[str],
    receive_timeout: float = 300,
    route: Callable[[str, str], int] | None = None,
) -> dict[str, Org]:
    """A CA and one folder per party. ``route(party, peer)`` is the port ``party`` dials to
    reach ``peer`` (default: the peer's own port; a benchmark puts a byte counter between)."""
    ca = certs.create_ca(root / "ca")
    ports = {party: free_port() for party in parties}
    orgs = {}
    for party in parties:
        folder = root / party
        certs.issue(ca, party, folder)
        peers = "".join(
            f'{peer} = "127.0.0.1:{route(party, peer) if route else ports[peer]}"\n'
            for peer in parties
            if peer != party
        )
        config = folder / "party.toml"
        config.write_text(
            f'party = "{party}"\nroot = "home"\nlisten = "127.0.0.1:{ports[party]}"\n'
            f"receive_timeout = {receive_timeout}\n\n[tls]\n"
            f'ca = "{ca.cert}"\ncert = "{party}.pem"\nkey = "{party}.key"\n\n[peers]\n{peers}'
        )
        orgs[party] = Org(party, folder, config, ports[party])
    return orgs


def env_of(org: Org, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without its ``PRIVREG_*`` settings, with the party's own
    Prefect home (and, when given, e.g. a shared test server's ``PREFECT_API_URL``)."""
    own = {k: v for k, v in os.environ.items() if not k.startswith("PRIVREG_")}
    pythonpath = os.pathsep.join(p for p in (str(ROOT), own.get("PYTHONPATH", "")) if p)
    own.update(
        PYTHONPATH=pythonpath, PREFECT_HOME=str(org.folder / "prefect"), GRPC_VERBOSITY="NONE"
    )
    return {**own, **(extra or {})}


def start(org: Org, command: str, args: list[str], extra: dict[str, str] | None = None, **kw):
    """``privreg party <command> --config <its party.toml> <args>`` as the party's own process."""
    return subprocess.Popen(
        [*CLI, command, "--config", str(org.config), *args],
        cwd=org.folder,
        env=env_of(org, extra),
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


def serve(org: Org, extra: dict[str, str] | None = None) -> subprocess.Popen:
    """The party's message endpoint (``privreg party serve``), once it listens."""
    return serve_all([org], extra)[0]


def serve_all(orgs: Iterable[Org], extra: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Every party's message endpoint, started side by side, once each listens."""
    orgs = list(orgs)
    servers = [start(org, "serve", [], extra) for org in orgs]
    for org, server in zip(orgs, servers, strict=True):
        line = server.stdout.readline() if server.stdout else ""
        if "serving its messages" not in line:
            for started in servers:
                started.kill()
            raise RuntimeError(f"{org.party}'s message endpoint did not start: {line!r}")
    return servers


def stop_all(processes: Iterable[subprocess.Popen], patience: float = 60.0) -> None:
    """End every process still running: all asked to stop at once (each service ends the sides
    it started, which tell their peers), then each waited for, killed past ``patience``."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=patience)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
