"""Organisations on their own hosts, over a shaped WAN: network namespaces on this machine.

Needs root (``ip netns``, ``tc``). The construction, for N organisations:

* one network namespace per organisation, ``<prefix><pid>-<i>``, with loopback and one
  interface ``wan0`` at ``10.77.0.<10 + i>/24``: its endpoint listens there, its processes run
  inside it (``ip netns exec``);
* a bridge namespace ``<prefix><pid>-br`` holding a Linux bridge at ``10.77.0.1`` and the other
  end of every organisation's veth pair: each organisation's link is its veth pair;
* bandwidth: ``tc qdisc ... tbf`` on both ends of each link (the organisation's upload and its
  download), so a path between two organisations runs at the link rate;
* latency: ``netem`` is missing from some kernels, so a userspace relay in this process (an
  asyncio TCP proxy whose sockets live in the bridge namespace) stands between each pair: a
  party's ``party.toml`` names ``10.77.0.1:<relay port>`` for each peer, and the relay holds
  every chunk for the one-way delay in each direction before passing it on. A round trip thus
  costs twice the delay plus the shaped links' serialisation. The relay counts the bytes of
  each direction, the turns (a reply after a request: one round trip) and the time bytes
  spend in it.

Limits: the relay ends TCP on both sides, so each TCP connection sees a sub-millisecond round
trip: slow start and the window's bandwidth-delay product of a real long path are not
reproduced (a single stream fills the link sooner than it would), and delay applies to whole
chunks as read, not per packet. No loss or jitter. All namespaces share this machine's CPUs.
Only addresses inside the namespaces made here are used; the parties reach the caller's
loopback services (a Prefect API) through a forwarder whose listening socket lives on each
namespace's own loopback.

A link is cut with :meth:`Wan.cut` (its interfaces down: packets stop, connections stall) or
:meth:`Wan.drop` (the relay closes its connections to that organisation and refuses new ones)
and restored with :meth:`Wan.restore`. Everything is removed on exit from the context manager,
at interpreter exit, and stale namespaces of dead harness processes at the next start.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.orgs import CLI, Org, env_of
from federation import certs

PREFIX = "privreg-wan-"
NETWORK = "10.77.0"
BRIDGE_IP = f"{NETWORK}.1"
ENDPOINT_PORT = 7700
RELAY_BASE_PORT = 20000
CLONE_NEWNET = 0x40000000
CHUNK = 1 << 16


# ---- namespaces ----------------------------------------------------------------------------
def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    """One ``ip`` command, in namespace ``ns`` when given."""
    command = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """Why the harness cannot run here, or None when it can (root and ``ip netns``)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    try:
        subprocess.run(["ip", "netns", "list"], capture_output=True, check=True)
        subprocess.run(["tc", "-V"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        return f"ip netns or tc unavailable: {error}"
    return None


def harness_namespaces(prefix: str = PREFIX) -> list[str]:
    """Every namespace whose name starts with the harness's prefix."""
    names = (line.split()[0] for line in ip("netns", "list").splitlines() if line.strip())
    return [name for name in names if name.startswith(prefix)]


def remove_namespace(name: str) -> None:
    """Kill the processes inside ``name`` (only ours live there), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "delete", name, check=False)


def clean_stale(prefix: str = PREFIX) -> list[str]:
    """Remove the namespaces left by harness processes that are no longer alive."""
    removed = []
    for name in harness_namespaces(prefix):
        owner = name[len(prefix) :].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            remove_namespace(name)
            removed.append(name)
    return removed


def in_namespace(name: str | None, make: Callable[[], Any]) -> Any:
    """``make()`` run by a thread that entered namespace ``name``: a socket created there
    belongs to that namespace for its whole life, whichever thread uses it later."""
    result: dict[str, Any] = {}

    def enter_and_make() -> None:
        try:
            if name:
                in_namespace_thread(name)
            result["value"] = make()
        except BaseException as error:  # handed back to the caller
            result["error"] = error

    thread = threading.Thread(target=enter_and_make)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def listener(ns: str | None, host: str, port: int) -> socket.socket:
    """A listening TCP socket inside ``ns``."""
    return in_namespace(ns, lambda: socket.create_server((host, port), backlog=128))


# ---- the relay -----------------------------------------------------------------------------
@dataclass
class Link:
    """What crossed the relay between a dialling party and a peer's endpoint."""

    dialler: str
    peer: str
    port: int
    up: int = 0  # bytes from the dialler to the peer
    down: int = 0  # bytes from the peer to the dialler
    turns: int = 0  # replies after requests, summed over connections: round trips
    connections: int = 0
    open: set[asyncio.StreamWriter] = field(default_factory=set)


class Relay:
    """A delay line per link, run by its own event loop thread; sockets in ``ns``."""

    def __init__(self, ns: str | None, delay: float) -> None:
        self.ns, self.delay = ns, delay
        self.links: dict[tuple[str, str], Link] = {}
        self.refused: set[str] = set()
        self.busy_seconds, self._busy_until = 0.0, 0.0
        self.loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.ns:  # every socket this loop opens (the upstream ones) lives in ``ns``
            in_namespace_thread(self.ns)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def add(self, dialler: str, peer: str, port: int, target: tuple[str, int]) -> Link:
        """Listen on ``port`` (at the bridge's address) and forward to ``target``."""
        link = Link(dialler, peer, port)
        self.links[dialler, peer] = link
        sock = listener(self.ns, BRIDGE_IP if self.ns else "127.0.0.1", port)

        async def serve() -> None:
            handler = lambda r, w: self._connection(link, target, r, w)  # noqa: E731
            self._servers.append(await asyncio.start_server(handler, sock=sock))

        asyncio.run_coroutine_threadsafe(serve(), self.loop).result()
        return link

    async def _connection(
        self, link: Link, target: tuple[str, int], reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:  # fmt: skip
        if {link.dialler, link.peer} & self.refused:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        link.connections += 1
        link.open |= {writer, up_writer}
        last = ["down"]  # the direction of the previous chunk on this connection
        await asyncio.gather(
            self._pump(link, reader, up_writer, "up", last),
            self._pump(link, up_reader, writer, "down", last),
            return_exceptions=True,
        )
        link.open -= {writer, up_writer}

    async def _pump(
        self, link: Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter,
        direction: str, last: list[str],
    ) -> None:  # fmt: skip
        """Read chunks, hold each for the delay, write them in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writer = asyncio.ensure_future(self._deliver(queue, sink))
        try:
            while data := await source.read(CHUNK):
                now = time.monotonic()
                if direction == "down" and last[0] == "up":
                    link.turns += 1
                last[0] = direction
                setattr(link, direction, getattr(link, direction) + len(data))
                self._mark_busy(now, now + self.delay)
                queue.put_nowait((now + self.delay, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(Exception):
                await writer

    async def _deliver(
        self, queue: asyncio.Queue[tuple[float, bytes]], sink: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                sink.write(data)
                await sink.drain()
                self._mark_busy(due, time.monotonic())
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()

    def _mark_busy(self, start: float, end: float) -> None:
        """Add [start, end] to the union of times some byte was held or being written."""
        if end <= self._busy_until:
            return
        self.busy_seconds += end - max(start, self._busy_until)
        self._busy_until = end

    def drop(self, party: str) -> None:
        """Close every connection to or from ``party`` and refuse new ones."""
        self.refused.add(party)

        def close_all() -> None:
            for link in self.links.values():
                if party in (link.dialler, link.peer):
                    for writer in list(link.open):
                        writer.transport.abort()

        self.loop.call_soon_threadsafe(close_all)

    def allow(self, party: str) -> None:
        self.refused.discard(party)

    def reset(self) -> None:
        """Zero the counters (between runs on the same organisations)."""
        self.busy_seconds, self._busy_until = 0.0, 0.0
        for link in self.links.values():
            link.up = link.down = link.turns = link.connections = 0

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            for link in self.links.values():
                for writer in list(link.open):
                    writer.transport.abort()

        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


def in_namespace_thread(name: str) -> None:
    """Move the calling thread (only it) into namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}") as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into {name}")


class Forward:
    """Unshaped, uncounted forwarding from ``127.0.0.1:port`` inside each namespace to the
    caller's ``127.0.0.1:port`` (e.g. a Prefect API the parties report to)."""

    def __init__(self, namespaces: Iterable[str], port: int) -> None:
        self.relay = Relay(None, 0.0)
        for i, ns in enumerate(namespaces):
            sock = listener(ns, "127.0.0.1", port)
            link = Link(ns, "caller", port)
            self.relay.links[ns, f"caller{i}"] = link

            async def serve(sock: socket.socket = sock, link: Link = link) -> None:
                target = ("127.0.0.1", port)
                handler = lambda r, w: self.relay._connection(link, target, r, w)  # noqa: E731
                self.relay._servers.append(await asyncio.start_server(handler, sock=sock))

            asyncio.run_coroutine_threadsafe(serve(), self.relay.loop).result()

    def close(self) -> None:
        self.relay.close()


# ---- the network ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """A link: rate in Mbit/s and round-trip time in ms (the relay's delay is half)."""

    name: str
    mbit: float
    rtt_ms: float


LAN = Setting("LAN", 1000, 0.5)
WAN = Setting("WAN", 100, 20)
FAR_WAN = Setting("far WAN", 20, 80)


class Wan:
    """N organisations' namespaces, links, relay and forwarders; a context manager."""

    def __init__(self, parties: list[str], setting: Setting, prefix: str = PREFIX) -> None:
        self.parties, self.setting, self.prefix = list(parties), setting, prefix
        self.tag = f"{prefix}{os.getpid()}-{next(_COUNTER)}"
        self.bridge = f"{self.tag}-br"
        self.ns = {party: f"{self.tag}-{i}" for i, party in enumerate(self.parties)}
        self.address = {party: f"{NETWORK}.{10 + i}" for i, party in enumerate(self.parties)}
        self.relay: Relay | None = None
        self.forwards: list[Forward] = []
        self.processes: list[subprocess.Popen] = []

    # set-up and tear-down
    def __enter__(self) -> Wan:
        clean_stale(self.prefix)
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _build(self) -> None:
        ip("netns", "add", self.bridge)
        ip("link", "set", "lo", "up", ns=self.bridge)
        ip("link", "add", "br0", "type", "bridge", ns=self.bridge)
        ip("addr", "add", f"{BRIDGE_IP}/24", "dev", "br0", ns=self.bridge)
        ip("link", "set", "br0", "up", ns=self.bridge)
        for i, party in enumerate(self.parties):
            ns, port = self.ns[party], f"v{i}"
            ip("netns", "add", ns)
            ip("link", "set", "lo", "up", ns=ns)
            ip("link", "add", port, "type", "veth", "peer", "name", "wan0", "netns", ns,
               ns=self.bridge)  # fmt: skip
            ip("link", "set", port, "master", "br0", "up", ns=self.bridge)
            ip("addr", "add", f"{self.address[party]}/24", "dev", "wan0", ns=ns)
            ip("link", "set", "wan0", "up", ns=ns)
            self._shape(ns, "wan0")
            self._shape(self.bridge, port)
        self.relay = Relay(self.bridge, self.setting.rtt_ms / 2000)
        for k, (dialler, peer) in enumerate(self.pairs()):
            target = (self.address[peer], ENDPOINT_PORT)
            self.relay.add(dialler, peer, RELAY_BASE_PORT + k, target)

    def _shape(self, ns: str, dev: str) -> None:
        """tbf at the setting's rate on ``dev``'s egress; a burst of 2 ms of the rate."""
        rate = self.setting.mbit * 1e6 / 8
        burst = max(int(rate * 0.002), 16_000)
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", f"{self.setting.mbit}mbit", "burst", str(burst), "latency", "100ms"],
            check=True, capture_output=True,
        )  # fmt: skip

    def close(self) -> None:
        """Stop our processes, the relay and forwarders; delete our namespaces."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
        for forward in self.forwards:
            forward.close()
        if self.relay:
            self.relay.close()
        for name in [*self.ns.values(), self.bridge]:
            if name in harness_namespaces(self.prefix):
                remove_namespace(name)
        _LIVE.discard(self)

    # using it
    def pairs(self) -> list[tuple[str, str]]:
        return [(a, b) for a in self.parties for b in self.parties if a != b]

    def peer_address(self, dialler: str, peer: str) -> str:
        """Where ``dialler`` reaches ``peer``: its relay port on the bridge."""
        assert self.relay
        return f"{BRIDGE_IP}:{self.relay.links[dialler, peer].port}"

    def forward(self, port: int) -> None:
        """Make the caller's ``127.0.0.1:port`` reachable at the same address in every
        organisation's namespace."""
        self.forwards.append(Forward(self.ns.values(), port))

    def cut(self, party: str) -> None:
        """Take ``party``'s link down (both ends): its packets stop, its connections stall."""
        ip("link", "set", "wan0", "down", ns=self.ns[party])
        ip("link", "set", f"v{self.parties.index(party)}", "down", ns=self.bridge)

    def restore(self, party: str) -> None:
        """Bring ``party``'s link back (and let the relay accept it again)."""
        ip("link", "set", f"v{self.parties.index(party)}", "up", ns=self.bridge)
        ip("link", "set", "wan0", "up", ns=self.ns[party])
        ip("addr", "replace", f"{self.address[party]}/24", "dev", "wan0", ns=self.ns[party])
        if self.relay:
            self.relay.allow(party)

    def drop(self, party: str) -> None:
        """The relay closes ``party``'s connections and refuses new ones until restored."""
        if self.relay:
            self.relay.drop(party)

    def popen(self, party: str, command: list[str], **kw: Any) -> subprocess.Popen:
        """``command`` run inside ``party``'s namespace; killed at close."""
        process = subprocess.Popen(["ip", "netns", "exec", self.ns[party], *command], **kw)
        self.processes.append(process)
        return process

    def wire(self) -> dict[str, dict[str, int]]:
        """Bytes each party sent and received through the relay, and its round trips."""
        assert self.relay
        out = {p: {"sent": 0, "received": 0, "turns": 0} for p in self.parties}
        for link in self.relay.links.values():
            out[link.dialler]["sent"] += link.up
            out[link.dialler]["received"] += link.down
            out[link.dialler]["turns"] += link.turns
            out[link.peer]["sent"] += link.down
            out[link.peer]["received"] += link.up
        return out


_COUNTER = iter(range(1 << 30))
_LIVE: set[Wan] = set()


@atexit.register
def _close_live() -> None:
    for wan in list(_LIVE):
        wan.close()


# ---- organisations on it -------------------------------------------------------------------
def make_orgs(root: Path, wan: Wan, receive_timeout: float = 600) -> dict[str, Org]:
    """A CA, and per party its certificate (named for the party, as the peers' TLS checks),
    its folder and a ``party.toml`` listening on its own address and naming each peer's relay
    port."""
    ca = certs.create_ca(root / "ca")
    orgs = {}
    for party in wan.parties:
        folder = root / party
        certs.issue(ca, party, folder)
        peers = "".join(
            f'{peer} = "{wan.peer_address(party, peer)}"\n' for peer in wan.parties if peer != party
        )
        config = folder / "party.toml"
        config.write_text(
            f'party = "{party}"\nroot = "home"\nlisten = "{wan.address[party]}:{ENDPOINT_PORT}"\n'
            f"receive_timeout = {receive_timeout}\n\n[tls]\n"
            f'ca = "{ca.cert}"\ncert = "{party}.pem"\nkey = "{party}.key"\n\n[peers]\n{peers}'
        )
        orgs[party] = Org(party, folder, config, ENDPOINT_PORT)
    return orgs


def start(
    wan: Wan, org: Org, command: str, args: list[str], extra: dict[str, str] | None = None,
    **kw: Any,
) -> subprocess.Popen:  # fmt: skip
    """``privreg party <command> --config <its party.toml> <args>`` inside its namespace."""
    kw.setdefault("stdout", subprocess.PIPE)
    return wan.popen(
        org.party, [*CLI, command, "--config", str(org.config), *args],
        cwd=org.folder, env=env_of(org, extra), text=True, **kw,
    )  # fmt: skip


def serve_all(
    wan: Wan, orgs: dict[str, Org], extra: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Every party's endpoint, in its namespace, once each listens."""
    servers = {party: start(wan, org, "serve", [], extra) for party, org in orgs.items()}
    for party, server in servers.items():
        line = server.stdout.readline() if server.stdout else ""
        if "serving its messages" not in line:
            raise RuntimeError(f"{party}'s message endpoint did not start: {line!r}")
    return list(servers.values())
