"""The organisation's one Prefect server, hosted (or found) by ``privreg party serve``.

Without it every side a proposal starts, and every ``privreg job`` command, runs its own
temporary Prefect server (25-60 s and ~200 MB each): an organisation's runs end up spread over
servers that are gone afterwards, no UI is up while they run, and a schedule cannot be served
at all. So ``party serve``

* uses the server that ``PREFECT_API_URL`` (its environment) or ``[prefect] api_url`` (its
  ``party.toml``) names, checked once at start; otherwise
* starts ``prefect server start --host 127.0.0.1 --port <[prefect] port, or a free one>`` as
  its own child under a lifetime watch (``core.lifetime``: it exits with the service, even a
  SIGKILLed one) and short SQLite lock waits (``privreg.prefect_sqlite``), with its state
  under ``<root>/prefect`` and its log in ``<root>/logs/prefect-server.log``, and stops it
  when the service stops.

Every side the service starts gets that server's ``PREFECT_API_URL``, and the URL is written
to ``<root>/prefect-api-url`` (0600), where the ``privreg job`` commands and the sides started by
hand at that party (``privreg party pipeline``, ``party psi``, ...) find it
(:func:`use_org_prefect`, :func:`side_prefect`). Nothing here imports Prefect.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.lifetime import installation_env, watched_command
from federation.party_config import PartyConfig
from privreg.prefect_sqlite import server_command
from storage.party_store import private_dirs

URL_FILE = "prefect-api-url"
"""Under the party's ``root``: the API URL of the organisation's server while it serves."""
ENV = "PREFECT_API_URL"
STARTUP_PATIENCE = 300.0
"""Seconds ``party serve`` waits for the server it started (a fresh one migrates its database:
~13 s alone, longer on a busy machine)."""
HEALTH_TIMEOUT = 3.0


class OrgPrefectError(RuntimeError):
    """The organisation's Prefect server cannot be used (not answering, not starting)."""


def healthy(api_url: str, timeout: float = HEALTH_TIMEOUT) -> bool:
    """Whether the Prefect API at ``api_url`` answers its health check."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError, http.client.HTTPException):
        return False


def url_file(root: Path) -> Path:
    return Path(root) / URL_FILE


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(when))


def _port(config: PartyConfig) -> int:
    """The configured port if it is free now (else a one-line refusal), or any free one."""
    wanted = config.prefect.port
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", wanted))
        except OSError:
            raise OrgPrefectError(
                f"cannot start party {config.party}'s Prefect server: 127.0.0.1:{wanted} "
                f"(prefect.port in its party.toml) is taken"
            ) from None
        return sock.getsockname()[1]


@dataclass
class OrgPrefect:
    """One organisation's Prefect server as its service uses it."""

    party: str
    api_url: str
    root: Path
    process: subprocess.Popen[bytes] | None = None  # None: a server this service did not start
    since: float = field(default_factory=time.time)  # when the service started (or found) it
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")

    @property
    def log(self) -> Path:
        return self.root / "logs" / "prefect-server.log"

    @classmethod
    def for_party(cls, config: PartyConfig) -> OrgPrefect:
        """The server named by ``PREFECT_API_URL`` or ``[prefect] api_url`` (it must answer
        now), else a new one started as this process's child (:meth:`wait_ready` waits)."""
        given, where = os.environ.get(ENV, ""), ENV
        if not given and config.prefect.api_url:
            given, where = config.prefect.api_url, "prefect.api_url in its party.toml"
        if given:
            given = given.rstrip("/")
            if not healthy(given):
                raise OrgPrefectError(
                    f"party {config.party}'s Prefect server {given} ({where}) does not answer "
                    f"at {given}/health: start it, or unset {where} to have the service start one"
                )
            return cls(config.party, given, config.root)
        port = _port(config)
        org = cls(config.party, f"http://127.0.0.1:{port}/api", config.root)
        org.process = org._start(port)
        return org

    def _start(self, port: int) -> subprocess.Popen[bytes]:
        """``prefect server start`` as this process's watched child, state under
        ``<root>/prefect``, output to its log (never to the service's own stdout)."""
        home = self.root / "prefect"
        private_dirs(home)
        private_dirs(self.log.parent)
        env = {k: v for k, v in os.environ.items() if k != ENV}
        env.update(PREFECT_HOME=str(home))
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no calls home
        start = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        command = watched_command(server_command(start))  # SQLite waits: privreg.prefect_sqlite
        out = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            return subprocess.Popen(
                command, cwd=self.root, env=installation_env(env), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            os.close(out)

    def wait_ready(
        self, say: Callable[[str], None] = print, patience: float = STARTUP_PATIENCE
    ) -> None:
        """Wait (saying for what, and since when) until the server answers, then write the
        URL file and say where the UI is. A server that exits or stays silent past
        ``patience`` seconds is one line naming its log."""
        if self.process is not None:
            say(f"party {self.party} waiting for its Prefect server to answer at "
                f"{self.api_url}/health since {_clock(self.since)} (log {self.log})")  # fmt: skip
            while not healthy(self.api_url, timeout=2.0):
                if (code := self.process.poll()) is not None:
                    raise OrgPrefectError(
                        f"party {self.party}'s Prefect server exited (status {code}) before "
                        f"it answered; see {self.log}"
                    )
                if time.time() - self.since > patience:
                    raise OrgPrefectError(
                        f"party {self.party}'s Prefect server did not answer at "
                        f"{self.api_url}/health within {patience:.0f} s; see {self.log}"
                    )
                time.sleep(0.5)
        self._write_url_file()
        self.ready.set()
        started = f" (up in {time.time() - self.since:.1f} s)" if self.process else ""
        say(f"party {self.party}'s Prefect{started}: UI {self.ui_url}, API {self.api_url}; "
            f"every side this service starts reports there")  # fmt: skip

    def _write_url_file(self) -> None:
        """``<root>/prefect-api-url``, 0600 from its first byte, replaced whole."""
        private_dirs(self.root)
        path = url_file(self.root)
        partial = path.with_name(f".{URL_FILE}.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.api_url + "\n")
        os.replace(partial, path)

    def side_environment(self, patience: float = 20.0) -> dict[str, str]:
        """What a side's environment needs to report to this server; a proposal that arrives
        while the server still starts waits up to ``patience`` seconds, then is refused."""
        if not self.ready.wait(patience):
            raise OrgPrefectError(
                f"party {self.party}'s Prefect server is still starting (since "
                f"{_clock(self.since)}); propose again in a minute"
            )
        return {ENV: self.api_url}

    def stop(self, patience: float = 20.0) -> None:
        """Forget the URL file (if it is still this server's) and stop the server this
        service started; a server it did not start is left running."""
        path = url_file(self.root)
        try:
            if path.read_text().strip() == self.api_url:
                path.unlink()
        except OSError:
            pass
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=patience)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def use_org_prefect(config: PartyConfig) -> str | None:
    """The Prefect a ``privreg job`` command at this party uses: ``PREFECT_API_URL`` if set,
    else the organisation's server its service wrote to ``<root>/prefect-api-url`` if that
    answers (then set as ``PREFECT_API_URL`` for this process: call this before Prefect is
    imported), else ``None`` (a temporary server, as before)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    try:
        url = url_file(config.root).read_text().strip()
    except OSError:
        return None
    if not url or not healthy(url):
        return None
    os.environ[ENV] = url
    return url


def side_prefect(config: PartyConfig, say: Callable[[str], None]) -> str | None:
    """The Prefect a side started by hand (``privreg party pipeline``, ``party psi``, ...)
    reports to: the organisation's, as for the sides its service starts (:func:`use_org_prefect`;
    call this before Prefect is imported); without one that answers, a temporary server as
    before, which ``say`` reports in one line."""
    url = use_org_prefect(config)
    if url is None:
        path = url_file(config.root)
        try:
            why = f"{path.read_text().strip() or 'nothing'} (from {path}) does not answer"
        except OSError:
            why = f"no {path}: privreg party serve is not running"
        say(f"party {config.party}: the organisation's Prefect server is not up ({why}); "
            f"this side runs on a temporary Prefect server of its own")  # fmt: skip
    return url
