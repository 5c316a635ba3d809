"""One organisation's party service configuration: one TOML file, only its own paths.

```toml
party = "clinic"                 # the name in its certificate
root = "clinic-home"             # its own folder: the messages it sent and received
listen = "0.0.0.0:7701"          # where peers fetch the messages addressed to them
receive_timeout = 600            # seconds a step waits for a peer's message

[tls]
ca = "certs/ca.pem"              # the CA (or bundle) every party's certificate chains to
cert = "certs/clinic.pem"
key = "certs/clinic.key"

[peers]
lab = "lab.example.org:7701"

[pins]                           # optional: a peer's certificate by its SHA-256 fingerprint
lab = "sha256:3f1c..."

[policy]                       # optional: unattended jobs (federation.standing_policy)
accept_from = ["lab"]

[limits]                         # optional: per-peer limits at the endpoint (see docs/operator.md)
fetches_per_peer = 4
proposals_per_peer = 2           # sides one peer's proposals may run here at once
proposals_total = 4              # sides all proposals may run here at once
message_bytes = 2147483648       # the cap of kinds the kind table does not list
[limits.kinds]
residual = 536870912             # one kind's cap

[prefect]                        # optional: the organisation's Prefect (privreg.org_prefect)
port = 4200                      # the port of the server ``party serve`` starts (default: free)
# api_url = "http://prefect.internal:4200/api"   # or: a server that runs already
```

Relative paths are read from the file's folder. A process runs as this party when
``PRIVREG_PARTY_CONFIG`` names the file (``privreg party serve`` sets it); it then knows no
other party's folder, database or key.

A local run (the embedded default: ``privreg run``, ``make demo``) runs every party's side in
one process, each side in its own thread under :func:`as_party` with a
:meth:`PartyConfig.local` configuration: the same side flows, over the shared-folder
transport instead of mutual TLS.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from federation.channel import check_name
from federation.endpoint_limits import EndpointLimits
from federation.message_caps import MessageCaps
from federation.standing_policy import StandingPolicy

ENV_VAR = "PRIVREG_PARTY_CONFIG"


class PartyConfigError(ValueError):
    """The party configuration file is missing a field or names something unusable."""


@dataclass(frozen=True)
class PrefectSettings:
    """``[prefect]``: where the organisation's one Prefect server is. ``api_url`` names a
    server that runs already; otherwise ``privreg party serve`` starts one on ``port`` (0:
    any free loopback port). ``PREFECT_API_URL`` in the service's environment wins over both."""

    api_url: str = ""
    port: int = 0

    @classmethod
    def from_table(cls, raw: dict[str, Any]) -> PrefectSettings:
        if unknown := sorted(set(raw) - {"api_url", "port"}):
            raise ValueError(f"unknown prefect keys {unknown}; known: ['api_url', 'port']")
        api_url, port = raw.get("api_url", ""), raw.get("port", 0)
        if not isinstance(api_url, str) or (api_url and "://" not in api_url):
            raise ValueError(f"prefect.api_url must be a URL (http://host:4200/api): {api_url!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ValueError(f"prefect.port must be a port number, not {port!r}")
        if api_url and port:
            raise ValueError(
                "prefect.api_url and prefect.port exclude each other: a server "
                "that runs already, or the port of the one the service starts"
            )
        return cls(api_url=api_url.rstrip("/"), port=port)


@dataclass(frozen=True)
class PartyConfig:
    party: str
    root: Path
    listen: str
    ca: Path
    cert: Path
    key: Path
    peers: dict[str, str] = field(default_factory=dict)
    receive_timeout: float = 600.0
    pins: dict[str, str] = field(default_factory=dict)
    policy: StandingPolicy = field(default_factory=StandingPolicy)
    limits: EndpointLimits = field(default_factory=EndpointLimits)
    caps: MessageCaps = field(default_factory=MessageCaps)
    prefect: PrefectSettings = field(default_factory=PrefectSettings)
    folder: Path | None = None  # the organisation's folder (its job files' paths start there)
    local: bool = False  # a side of a local run: shared-folder transport, no certificates

    @classmethod
    def local_party(
        cls, party: str, root: str | Path, peers: Sequence[str], folder: str | Path = "."
    ) -> PartyConfig:
        """One party's side of a local run: messages in the shared folder ``root``, every
        other party of the run a peer, the operator's own folder ``folder`` (it holds every
        party's files, so no path is confined to a party's folder)."""
        nowhere = Path()
        return cls(
            party=check_name(party, "party"),
            root=Path(root).resolve(),
            listen="",
            ca=nowhere,
            cert=nowhere,
            key=nowhere,
            peers={peer: "" for peer in peers if peer != party},
            receive_timeout=float(os.environ.get("PRIVREG_RECEIVE_TIMEOUT") or 600.0),
            folder=Path(folder).resolve(),
            local=True,
        )

    @classmethod
    def load(cls, path: str | Path) -> PartyConfig:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise PartyConfigError(f"{path}: {error}") from error
        here = path.parent

        def where(value: object, what: str) -> Path:
            if not isinstance(value, str) or not value:
                raise PartyConfigError(f"{path}: {what} must be a path")
            return (here / value).resolve()

        try:
            tls, peers = raw.get("tls", {}), raw.get("peers", {})
            party = check_name(raw["party"], "party")
            for peer, address in peers.items():
                check_name(peer, "peer")
                if peer == party or not isinstance(address, str):
                    raise PartyConfigError(f"{path}: peer {peer!r} needs an address host:port")
            return cls(
                party=party,
                root=where(raw["root"], "root"),
                listen=str(raw.get("listen", "127.0.0.1:0")),
                ca=where(tls.get("ca"), "tls.ca"),
                cert=where(tls.get("cert"), "tls.cert"),
                key=where(tls.get("key"), "tls.key"),
                peers=dict(peers),
                receive_timeout=float(raw.get("receive_timeout", 600.0)),
                pins=_pins(raw.get("pins", {})),
                policy=StandingPolicy.from_table(raw.get("policy", {})),
                folder=here.resolve(),
                prefect=PrefectSettings.from_table(raw.get("prefect", {})),
                **_limits(raw.get("limits", {})),
            )
        except KeyError as error:
            raise PartyConfigError(f"{path}: missing {error.args[0]!r}") from None
        except ValueError as error:
            raise PartyConfigError(f"{path}: {error}") from None

    def own_table(self, descriptor: dict[str, Any]) -> dict[str, Any]:
        """``descriptor`` if it names this party's own table; another party's is refused."""
        owner = descriptor.get("party", Path(descriptor["database"]).stem)
        if owner != self.party:
            raise PartyConfigError(f"the table belongs to {owner!r}, not to {self.party!r}")
        return descriptor

    def address_of(self, peer: str) -> str:
        if peer not in self.peers:
            raise PartyConfigError(f"party {self.party!r} has no address for peer {peer!r}")
        return self.peers[peer]


def _pins(raw: dict[str, Any]) -> dict[str, str]:
    """``[pins]``: peer name -> ``sha256:<64 hex digits>`` of its certificate."""
    pins = {}
    for peer, value in raw.items():
        check_name(peer, "pinned peer")
        text = value if isinstance(value, str) else ""
        digits = text.removeprefix("sha256:").replace(":", "").lower()
        if len(digits) != 64 or any(c not in "0123456789abcdef" for c in digits):
            raise ValueError(f"pins.{peer} must be 'sha256:' and 64 hex digits, not {value!r}")
        pins[peer] = "sha256:" + digits
    return pins


_LIMIT_KEYS = set(EndpointLimits.__dataclass_fields__)


def _limits(raw: dict[str, Any]) -> dict[str, Any]:
    """``[limits]``: the endpoint's per-peer limits and the receiver's message caps."""
    if unknown := sorted(set(raw) - _LIMIT_KEYS - {"message_bytes", "kinds"}):
        known = [*sorted(_LIMIT_KEYS), "message_bytes", "kinds"]
        raise ValueError(f"unknown limits {unknown}; known: {known}")
    kinds = dict(raw.get("kinds", {}))
    for kind in kinds:  # "share_" (every kind starting with it) is allowed
        check_name(kind.rstrip("_"), "limits.kinds key")
    default = {"default": raw["message_bytes"]} if "message_bytes" in raw else {}
    return {
        "limits": EndpointLimits(**{k: raw[k] for k in _LIMIT_KEYS & set(raw)}),
        "caps": MessageCaps(**default, kinds=kinds),
    }


@functools.cache
def _load_cached(path: str) -> PartyConfig:
    return PartyConfig.load(path)


_CURRENT: contextvars.ContextVar[PartyConfig | None] = contextvars.ContextVar(
    "privreg_party", default=None
)


@contextlib.contextmanager
def as_party(config: PartyConfig) -> Iterator[PartyConfig]:
    """Run the block as ``config``'s party (a side of a local run, in its own thread)."""
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)


def active_config() -> PartyConfig | None:
    """The party this code runs as: the side's configuration (:func:`as_party`), else the
    process's (``PRIVREG_PARTY_CONFIG``), else ``None`` (a party-less helper)."""
    if (config := _CURRENT.get()) is not None:
        return config
    path = os.environ.get(ENV_VAR)
    return _load_cached(path) if path else None
