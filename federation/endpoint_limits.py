"""What one peer may hold at a party's message endpoint, so no peer can starve the others.

Every fetch takes a slot of its caller's; a fetch held open for a message not sent yet (a
long poll) also takes one of the caller's long-poll slots, and a message being streamed
counts its size against the caller's bytes in flight. A call beyond a limit is refused at
once with the limit's name and value, and the caller retries (the receive timeout still
bounds its wait); other peers' calls are untouched. The endpoint's worker count leaves every
configured peer its full share plus spares (:meth:`EndpointLimits.workers`), so one peer can
never hold all workers, and a stream that runs past ``stream_seconds`` (a peer reading
slowly) is cancelled. A peer's ``Propose`` and ``Status`` calls take a fetch slot too while
they run, and the party service runs at most ``proposals_per_peer`` sides proposed by one peer
and ``proposals_total`` in all at a time (each side is a process of its own).

Nothing here imports gRPC: :mod:`federation.transport_grpc` applies it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EndpointLimits:
    """Per-peer limits at one endpoint (``[limits]`` in ``party.toml`` overrides each)."""

    fetches_per_peer: int = 4
    long_polls_per_peer: int = 2
    bytes_in_flight_per_peer: int = 1 << 30
    stream_seconds: float = 900.0
    spare_workers: int = 4
    proposals_per_peer: int = 2  # sides one peer's proposals may have running at once
    proposals_total: int = 4  # sides all proposals may have running at once (one machine)

    def __post_init__(self) -> None:
        for item in fields(self):
            if not getattr(self, item.name) > 0:
                raise ValueError(f"limits.{item.name} must be positive")
        if self.long_polls_per_peer > self.fetches_per_peer:
            raise ValueError("limits.long_polls_per_peer cannot exceed limits.fetches_per_peer")

    def workers(self, peers: int) -> int:
        """Threads serving fetches: every configured peer's full share, one more share for
        callers not listed, and spares, so no single peer can hold all of them."""
        return self.fetches_per_peer * (peers + 1) + self.spare_workers


class LimitExceededError(Exception):
    """A peer asked for more than its share; the message names the limit."""


class PeerGate:
    """The counters of one endpoint, per calling peer."""

    def __init__(self, party: str, limits: EndpointLimits) -> None:
        self.party, self.limits = party, limits
        self._lock = threading.Lock()
        self._fetches: dict[str, int] = {}
        self._polls: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def open(self, peer: str) -> Ticket:
        """A fetch slot for ``peer``, or :class:`LimitExceededError`."""
        with self._lock:
            held = self._fetches.get(peer, 0)
            if held >= self.limits.fetches_per_peer:
                raise self._refusal(peer, "fetches_per_peer", f"{held} fetches running")
            self._fetches[peer] = held + 1
        return Ticket(self, peer)

    def _refusal(self, peer: str, limit: str, state: str) -> LimitExceededError:
        value = getattr(self.limits, limit)
        return LimitExceededError(
            f"party {self.party} refuses: peer {peer} has {state}, the limit is "
            f"limits.{limit} = {value}; it may retry when one ends"
        )


class Ticket:
    """One fetch's share of its peer's limits; :meth:`release` (idempotent) returns all."""

    def __init__(self, gate: PeerGate, peer: str) -> None:
        self.gate, self.peer = gate, peer
        self._polling = False
        self._reserved = 0
        self._released = False

    def start_long_poll(self) -> None:
        gate = self.gate
        with gate._lock:
            held = gate._polls.get(self.peer, 0)
            if held >= gate.limits.long_polls_per_peer:
                raise gate._refusal(self.peer, "long_polls_per_peer", f"{held} long polls held")
            gate._polls[self.peer] = held + 1
            self._polling = True

    def end_long_poll(self) -> None:
        with self.gate._lock:
            self._end_poll()

    def reserve(self, size: int) -> None:
        """Count ``size`` bytes against the peer; a lone message may exceed the cap (else a
        message larger than it could never be fetched), a second one may not."""
        gate = self.gate
        with gate._lock:
            held = gate._bytes.get(self.peer, 0)
            if held and held + size > gate.limits.bytes_in_flight_per_peer:
                raise gate._refusal(
                    self.peer, "bytes_in_flight_per_peer", f"{held} bytes in flight"
                )
            gate._bytes[self.peer] = held + size
            self._reserved += size

    def release(self) -> None:
        gate = self.gate
        with gate._lock:
            if self._released:
                return
            self._released = True
            self._end_poll()
            gate._bytes[self.peer] = gate._bytes.get(self.peer, 0) - self._reserved
            gate._fetches[self.peer] = gate._fetches.get(self.peer, 0) - 1
            for counts in (gate._bytes, gate._fetches):
                if counts.get(self.peer) == 0:
                    del counts[self.peer]

    def _end_poll(self) -> None:
        if self._polling:
            self._polling = False
            self.gate._polls[self.peer] -= 1
            if not self.gate._polls[self.peer]:
                del self.gate._polls[self.peer]
