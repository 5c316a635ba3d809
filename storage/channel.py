"""The one channel through which every value crosses a party boundary.

A message is keyed by (run, round, sender, receiver, kind) and persisted as one file under
the run's folder, written atomically, so that:

* tests can audit exactly what crossed (:meth:`Channel.log` and :meth:`Channel.read_raw`);
* a retried step finds the messages it was sent and can replay;
* moving parties to separate processes or hosts only means replacing the file system with a
  shared one or a transport that implements the same two calls.

A party holds a :class:`PartyEndpoint`, which can send only as that party and receive only
messages addressed to it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage import codec

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,80}$")


class ChannelError(RuntimeError):
    """A message is missing or a party tried to read what is not addressed to it."""


def _check_name(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_.-]{{1,80}}")
    return value


@dataclass(frozen=True)
class MessageRecord:
    run: str
    round: int
    sender: str
    receiver: str
    kind: str
    size: int
    sha256: str


class Channel:
    """All messages of one run (a job), stored under ``root/runs/<run>/messages``."""

    def __init__(self, root: str | Path, run: str) -> None:
        self.run = _check_name(run, "run")
        self.folder = Path(root) / "runs" / run / "messages"

    def endpoint(self, party: str) -> PartyEndpoint:
        return PartyEndpoint(self, _check_name(party, "party"))

    def _path(self, round_: int, sender: str, receiver: str, kind: str) -> Path:
        if round_ < 0:
            raise ValueError("round must be >= 0")
        return self.folder / f"r{round_:06d}" / f"{sender}__{receiver}__{_check_name(kind, 'kind')}"

    def _write(
        self, round_: int, sender: str, receiver: str, kind: str, payload: Any
    ) -> MessageRecord:
        data = codec.dumps(payload)
        path = self._path(round_, sender, receiver, kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return MessageRecord(
            self.run, round_, sender, receiver, kind, len(data), hashlib.sha256(data).hexdigest()
        )

    def _read(self, round_: int, sender: str, receiver: str, kind: str) -> Any:
        path = self._path(round_, sender, receiver, kind)
        if not path.exists():
            raise ChannelError(
                f"run {self.run}: no {kind!r} message from {sender} to {receiver} in round {round_}"
            )
        return codec.loads(path.read_bytes())

    def log(self) -> list[MessageRecord]:
        """Every message of the run, for audits and for bytes-exchanged reports."""
        records = []
        if not self.folder.exists():
            return records
        for path in sorted(self.folder.glob("r*/*__*__*")):
            sender, receiver, kind = path.name.split("__", 2)
            data = path.read_bytes()
            records.append(
                MessageRecord(
                    self.run,
                    int(path.parent.name[1:]),
                    sender,
                    receiver,
                    kind,
                    len(data),
                    hashlib.sha256(data).hexdigest(),
                )
            )
        return records

    def read_raw(self, record: MessageRecord) -> bytes:
        """The bytes that crossed, exactly as stored (for audits)."""
        return self._path(record.round, record.sender, record.receiver, record.kind).read_bytes()

    def bytes_by_party(self) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for record in self.log():
            totals.setdefault(record.sender, {"sent": 0, "received": 0})["sent"] += record.size
            totals.setdefault(record.receiver, {"sent": 0, "received": 0})["received"] += (
                record.size
            )
        return totals


@dataclass(frozen=True)
class PartyEndpoint:
    """One party's view of the channel."""

    channel: Channel
    party: str

    def send(self, receiver: str, kind: str, payload: Any, round: int = 0) -> MessageRecord:
        if receiver == self.party:
            raise ChannelError(f"{self.party} cannot send a message to itself")
        return self.channel._write(
            round, self.party, _check_name(receiver, "receiver"), kind, payload
        )

    def receive(self, sender: str, kind: str, round: int = 0) -> Any:
        return self.channel._read(round, _check_name(sender, "sender"), self.party, kind)
