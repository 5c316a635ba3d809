"""The one channel through which every value crosses a party boundary.

Protocol code holds a :class:`PartyEndpoint` and calls only ``send`` and ``receive``; it never
learns how a message travels. A :class:`Transport` does that:

* :class:`FileTransport` (the embedded default): one folder that every party of the process
  shares, ``<root>/runs/<job>/messages/r<round>/<sender>__<receiver>__<kind>``;
* ``federation.transport_grpc.GrpcTransport``: each party keeps its own folder of the same layout
  (what it sent and what it received) and fetches its messages from the sender over mutual TLS.

Whatever the transport, a message is keyed by (job, round, sender, receiver, kind) and is
durable and idempotent: sending the same bytes under a key again is a no-op, sending different
bytes under a key already used is refused with a :class:`ChannelError` naming the key.
``receive`` waits up to a timeout and then raises :class:`MessageTimeoutError` naming the peer, job,
round and kind. A party can send only as itself and receive only what is addressed to it.

A party may *relay* messages it received (:meth:`PartyEndpoint.relay`): one message carrying
each original's bytes with its sender's proof, so that a receiver checks every entry as its
sender's (:meth:`PartyEndpoint.receive_relayed`) and the relaying party cannot alter, swap or
replay one unnoticed. The transport says what a proof is: over the network the sender's
signature of the original's key and digest, on one shared folder none (the folder is trusted,
and the receiver compares each entry with the original there).
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from federation import folder_watch, watchers
from storage import codec

# Names are path components and are joined with "__": they start and end with a letter or digit
# and never hold "__" or "..", so "<sender>__<receiver>__<kind>" splits one way only.
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,78}[A-Za-z0-9])?")
_SEPARATOR = "__"
_DEFAULT_TIMEOUT = float(os.environ.get("PRIVREG_RECEIVE_TIMEOUT", "0"))


class ChannelError(RuntimeError):
    """A message is missing, conflicts with one already sent, or is not the caller's to read."""


class MessageConflictError(ChannelError, ValueError):
    """Other bytes under a key already used: permanent (a retry fails the same way)."""


class MessageTimeoutError(ChannelError):
    """A message did not arrive in time (the peer is late, down, or gone)."""


class TermsBindingError(ChannelError):
    """A message bound to other terms than this party agreed for the job (or to none)."""


class RelayError(ChannelError):
    """A relayed entry is not what its named sender sent (altered, swapped, replayed) or is
    missing; the message names that sender."""


class PeerUnreachableError(ChannelError):
    """A peer's endpoint did not answer (down, not started, or the network is cut)."""


def check_name(value: str, what: str) -> str:
    """A party, kind or job name that is safe as a path component and cannot collide."""
    if (
        not isinstance(value, str)
        or not _NAME.fullmatch(value)
        or _SEPARATOR in value
        or ".." in value
    ):
        raise ValueError(
            f"{what} {value!r} must be 1-80 of [A-Za-z0-9_.-], start and end with a letter or "
            f"digit, and contain neither {_SEPARATOR!r} nor '..'"
        )
    return value


@dataclass(frozen=True)
class MessageKey:
    """Where a message belongs; every field is validated, so a key maps to one file only."""

    run: str
    round: int
    sender: str
    receiver: str
    kind: str

    def __post_init__(self) -> None:
        check_name(self.run, "job")
        check_name(self.sender, "sender")
        check_name(self.receiver, "receiver")
        check_name(self.kind, "kind")
        if isinstance(self.round, bool) or not 0 <= operator.index(self.round) < 10**6:
            raise ValueError(f"round {self.round!r} must be an int in [0, 10^6)")
        object.__setattr__(self, "round", operator.index(self.round))

    def describe(self) -> str:
        return (
            f"{self.kind!r} message from {self.sender} to {self.receiver} "
            f"in round {self.round} of job {self.run}"
        )

    def relative_path(self) -> Path:
        name = _SEPARATOR.join((self.sender, self.receiver, self.kind))
        return Path("runs") / self.run / "messages" / f"r{self.round:06d}" / name


@dataclass(frozen=True)
class MessageRecord:
    run: str
    round: int
    sender: str
    receiver: str
    kind: str
    size: int
    sha256: str

    @property
    def key(self) -> MessageKey:
        return MessageKey(self.run, self.round, self.sender, self.receiver, self.kind)

    @property
    def base_kind(self) -> str:
        """The kind without its attempt suffix (``secagg_keys.<session>`` is ``secagg_keys``):
        a protocol whose retries must not reuse a key names each attempt after a dot."""
        return self.kind.split(".", 1)[0]


class Transport(Protocol):
    """How encoded messages move. ``party`` is ``None`` when one process hosts every party."""

    party: str | None

    def put(self, key: MessageKey, data: bytes) -> None:
        """Store (and make available to ``key.receiver``) durably; idempotent, refuses conflicts."""

    def put_all(self, items: Sequence[tuple[MessageKey, bytes]]) -> None:
        """:meth:`put` of several messages (a broadcast, a round's requests), synced together."""

    def get(self, key: MessageKey, timeout: float) -> bytes:
        """The message's bytes, waiting up to ``timeout`` seconds (:class:`MessageTimeoutError`)."""

    def store(self) -> MessageFolder:
        """The local folder of what this process sent and received (for audits)."""

    def publish_status(self, run: str, party: str, data: bytes) -> None:
        """Make ``party``'s current status record of ``run`` readable by its peers (replaces
        the previous one: unlike a message, a status is meant to change)."""

    def peer_status(self, run: str, peer: str) -> bytes | None:
        """``peer``'s current status record of ``run``, ``None`` if it has none yet; raises
        :class:`PeerUnreachableError` when the peer cannot be asked."""

    def proof(self, key: MessageKey) -> bytes:
        """What shows that ``key.sender`` sent the stored message under ``key`` (to relay
        it); ``b""`` where the transport needs none."""

    def check_relayed(self, key: MessageKey, data: bytes, proof: bytes) -> None:
        """Raise :class:`ChannelError` unless ``data`` is what ``key.sender`` sent under
        ``key``, as ``proof`` (from :meth:`proof` at the relaying party) shows."""


class MessageFolder:
    """Messages as files under ``root``, written atomically and never overwritten."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._made: set[Path] = set()  # folders known to exist (a round's folder is reused)

    def _in_folder(self, folder: Path, action: Callable[[], Any]) -> Any:
        """``action()``, which creates a file in ``folder``, making the folder first if this
        process has not seen it (or it was removed since)."""
        if folder in self._made:
            try:
                return action()
            except FileNotFoundError:
                self._made.discard(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._made.add(folder)
        return action()

    def path(self, key: MessageKey) -> Path:
        return self.root / key.relative_path()

    def find(self, key: MessageKey) -> bytes | None:
        path = self.path(key)
        return path.read_bytes() if path.exists() else None

    def staging(self, key: MessageKey) -> Path:
        """A fresh temporary file beside the message's place (same file system, for rename)."""
        folder = self.path(key).parent
        fd, tmp = self._in_folder(folder, lambda: tempfile.mkstemp(dir=folder, prefix=".tmp-"))
        os.close(fd)
        return Path(tmp)

    def put(self, key: MessageKey, data: bytes) -> None:
        self.put_all([(key, data)])

    def put_all(self, items: Sequence[tuple[MessageKey, bytes]]) -> None:
        """Several messages, each durable before any is visible: every distinct payload is
        one file, written, synced, then linked under the name of each key that carries it;
        each folder is synced once after.

        Why: a broadcast (a round's call, a masked input for the coordinator and every peer)
        or a round's requests would otherwise pay two syncs per receiver, ~8 ms each on a
        common disk; one file linked under ten names costs about what one message did. A key
        already holding the same bytes is left as it is (idempotent); one holding other bytes
        is refused with :class:`MessageConflictError` once the others are in place.
        """
        groups: dict[str, tuple[bytes, list[MessageKey]]] = {}
        for key, data in items:
            groups.setdefault(_sha256(data), (data, []))[1].append(key)
        staged: list[tuple[Path, str, list[MessageKey]]] = []
        try:
            for digest, (data, keys) in groups.items():
                tmp = self.staging(keys[0])
                staged.append((tmp, digest, keys))
                with open(tmp, "wb") as handle:
                    handle.write(data)
            for tmp, _, _ in staged:
                with open(tmp, "rb+") as handle:
                    os.fsync(handle.fileno())
            linked, conflict = set(), None
            for tmp, digest, keys in staged:
                for key in keys:
                    if self._link(tmp, key):
                        linked.add(self.path(key).parent)
                    elif conflict is None and _digest(self.path(key)) != digest:
                        conflict = key
            for folder in linked:
                _fsync_folder(folder)  # the new names survive a crash too
            if conflict is not None:
                raise _conflict(conflict)
        finally:
            for tmp, _, _ in staged:
                tmp.unlink(missing_ok=True)

    def _link(self, tmp: Path, key: MessageKey) -> bool:
        """Give ``tmp`` the message's name; False if the name exists already (``os.link``
        creates it only if it does not, so two writers cannot race)."""
        path = self.path(key)
        try:
            self._in_folder(path.parent, lambda: os.link(tmp, path))
        except FileExistsError:
            return False
        return True

    def commit_received(self, key: MessageKey, tmp: Path) -> None:
        """Move a fully written received copy into place, unsynced, unless the key holds other
        bytes (refused): the sender keeps the durable one for the job, so a copy lost or torn
        by a crash is fetched again (see :meth:`note_received`)."""
        try:
            if not self._link(tmp, key) and _digest(self.path(key)) != _digest(tmp):
                raise _conflict(key)
        finally:
            tmp.unlink(missing_ok=True)

    def received_path(self, key: MessageKey) -> Path:
        """Where the size and SHA-256 of a received copy are noted (beside the messages)."""
        relative = key.relative_path()
        return self.root / "runs" / key.run / "received" / relative.parent.name / relative.name

    def note_received(self, key: MessageKey, size: int, sha256: str, proof: bytes = b"") -> None:
        """Note what the sender announced (and signed) for a copy about to be stored unsynced.

        Why: a received copy is not synced (that cost ~10 ms a message); after a crash of the
        machine it may be torn or empty, and :meth:`received_intact` tells so by this note.
        Written before the copy gets its name, so a copy with a name always has a note unless
        the machine crashed (then the note may be missing or torn too: the copy is fetched
        again, never trusted). ``proof``: the sender's proof, kept so this party can relay
        the message (:meth:`PartyEndpoint.relay`)."""
        path = self.received_path(key)
        note = f"{size} {sha256}\n{proof.hex()}\n"
        self._in_folder(path.parent, lambda: path.write_text(note))

    def received_intact(self, key: MessageKey) -> bool:
        """Whether the stored copy of a received message has the size and digest noted."""
        try:
            size, sha256 = self.received_path(key).read_text().split("\n", 1)[0].split()
            path = self.path(key)
            return path.stat().st_size == int(size) and _digest(path) == sha256
        except (OSError, ValueError):
            return False

    def received_proof(self, key: MessageKey) -> bytes:
        """The sender's proof noted with a received copy (``b""`` if none was noted)."""
        try:
            lines = self.received_path(key).read_text().split("\n")
            return bytes.fromhex(lines[1]) if len(lines) > 1 else b""
        except (OSError, ValueError):
            return b""

    def status_path(self, run: str, party: str) -> Path:
        """Where ``party`` keeps its current status of ``run`` (see federation.status)."""
        return self.root / "runs" / check_name(run, "job") / "status" / check_name(party, "party")

    def write_status(self, run: str, party: str, data: bytes) -> None:
        """Replace the status record atomically: a reader sees the old or the new one."""
        path = self.status_path(run, party)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)

    def read_status(self, run: str, party: str) -> bytes | None:
        try:
            return self.status_path(run, party).read_bytes()
        except FileNotFoundError:
            return None

    def records(self, run: str) -> list[MessageRecord]:
        folder = self.root / "runs" / run / "messages"
        records = []
        for path in sorted(folder.glob("r*/*__*__*")):
            sender, receiver, kind = path.name.split(_SEPARATOR)
            data = path.read_bytes()
            records.append(
                MessageRecord(
                    run,
                    int(path.parent.name[1:]),
                    sender,
                    receiver,
                    kind,
                    len(data),
                    _sha256(data),
                )
            )
        return records


def _conflict(key: MessageKey) -> MessageConflictError:
    return MessageConflictError(
        f"refused: a different payload for the {key.describe()}, which was already sent with "
        "other content (a message is never replaced)"
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _peers_alive() -> bool:
    """Between a wait's wake-ups: raises a job's failure elsewhere (the wait ends at once)."""
    watchers.check_peers()
    return True


class FileTransport:
    """Every party of one process shares ``root``; ``receive`` waits for the file to appear."""

    party: str | None = None

    def __init__(self, root: str | Path) -> None:
        self.folder = MessageFolder(root)

    def put(self, key: MessageKey, data: bytes) -> None:
        self.folder.put(key, data)

    def put_all(self, items: Sequence[tuple[MessageKey, bytes]]) -> None:
        self.folder.put_all(items)

    def get(self, key: MessageKey, timeout: float) -> bytes:
        """Returns as soon as the sender links the file into place: the wait is woken by the
        file system (:mod:`federation.folder_watch`), not by a poll of its own."""
        deadline = time.monotonic() + timeout
        while (data := self.folder.find(key)) is None:
            watchers.check_peers()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if watchers.patient(key):  # its sender is alive, busy with an earlier job
                    deadline = time.monotonic() + timeout
                    continue
                raise MessageTimeoutError(
                    f"gave up after {timeout:g} s waiting for the {key.describe()}"
                )
            wake = watchers.check_within(remaining)  # a peer's failure ends the wait
            folder_watch.wait_for(self.folder.path(key), wake, _peers_alive)
        return data

    def store(self) -> MessageFolder:
        return self.folder

    def publish_status(self, run: str, party: str, data: bytes) -> None:
        self.folder.write_status(run, party, data)

    def peer_status(self, run: str, peer: str) -> bytes | None:
        return self.folder.read_status(run, peer)

    def proof(self, key: MessageKey) -> bytes:
        return b""  # the shared folder itself holds the original

    def check_relayed(self, key: MessageKey, data: bytes, proof: bytes) -> None:
        """The shared folder is trusted: ``data`` must be the original it holds."""
        original = self.folder.find(key)
        if original is None or bytes(original) != data:
            found = "holds other bytes" if original is not None else "holds no such message"
            raise ChannelError(f"the shared folder {found} as the {key.describe()}")


class Channel:
    """All messages of one run (a job) as this process sees them."""

    def __init__(
        self,
        root: str | Path,
        run: str,
        transport: Transport | None = None,
        timeout: float | None = None,
    ) -> None:
        self.run = check_name(run, "job")
        self.transport = transport or FileTransport(root)
        self.timeout = _DEFAULT_TIMEOUT if timeout is None else timeout
        self.folder = self.transport.store().root / "runs" / run / "messages"

    def endpoint(self, party: str) -> PartyEndpoint:
        check_name(party, "party")
        if self.transport.party not in (None, party):
            raise ChannelError(
                f"this process is party {self.transport.party!r}; it cannot act as {party!r}"
            )
        return PartyEndpoint(self, party)

    def key(self, round_: int, sender: str, receiver: str, kind: str) -> MessageKey:
        return MessageKey(self.run, round_, sender, receiver, kind)

    def _write(
        self, round_: int, sender: str, receiver: str, kind: str, payload: Any
    ) -> MessageRecord:
        """One message: :meth:`_write_each` with one receiver."""
        return self._write_each(round_, sender, kind, {receiver: payload})[0]

    def _write_each(
        self, round_: int, sender: str, kind: str, payloads: Mapping[str, Any]
    ) -> list[MessageRecord]:
        """Encode and hand to the transport, the one place messages are written: a payload per
        receiver, stored together (:meth:`MessageFolder.put_all`); a payload object given to
        several receivers is encoded once."""
        encoded: dict[int, bytes] = {}
        items = []
        for receiver, payload in payloads.items():
            if id(payload) not in encoded:
                encoded[id(payload)] = codec.dumps(payload, terms=watchers.terms_of(self.run))
            items.append((self.key(round_, sender, receiver, kind), encoded[id(payload)]))
        self.transport.put_all(items)
        return [
            MessageRecord(k.run, k.round, sender, k.receiver, kind, len(data), _sha256(data))
            for k, data in items
        ]

    def log(self) -> list[MessageRecord]:
        """Every message this process sent or received in the run (audits, bytes exchanged)."""
        return self.transport.store().records(self.run)

    def read_raw(self, record: MessageRecord) -> bytes:
        """The bytes that crossed, exactly as stored (for audits)."""
        return self.transport.store().path(record.key).read_bytes()

    def bytes_by_party(self) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for record in self.log():
            totals.setdefault(record.sender, {"sent": 0, "received": 0})["sent"] += record.size
            totals.setdefault(record.receiver, {"sent": 0, "received": 0})["received"] += (
                record.size
            )
        return totals


def _check_terms(key: MessageKey, data: bytes) -> None:
    """Refuse a message of an agreed job that is not bound to the terms this party agreed."""
    expected = watchers.terms_of(key.run)
    if expected is None:
        return
    found = codec.bound_terms(data)
    if found != expected:
        carried = f"terms {found[:12]}" if found else "no terms"
        raise TermsBindingError(
            f"refused the {key.describe()}: it is bound to {carried}, but this party agreed to "
            f"terms {expected[:12]} for the job ({key.sender} runs the job under other terms)"
        )


@dataclass(frozen=True)
class PartyEndpoint:
    """One party's view of the channel: it sends as itself and reads what is addressed to it."""

    channel: Channel
    party: str

    def send(self, receiver: str, kind: str, payload: Any, round: int = 0) -> MessageRecord:
        if receiver == self.party:
            raise ChannelError(f"{self.party} cannot send a message to itself")
        return self.channel._write(round, self.party, receiver, kind, payload)

    def send_many(
        self, receivers: Sequence[str], kind: str, payload: Any, round: int = 0
    ) -> list[MessageRecord]:
        """The same payload to each of ``receivers`` (one message each, written once)."""
        return self.send_each(dict.fromkeys(receivers, payload), kind, round=round)

    def send_each(
        self, payloads: Mapping[str, Any], kind: str, round: int = 0
    ) -> list[MessageRecord]:
        """A payload per receiver, all made durable together (one sync per distinct payload
        and one per folder, not two per message)."""
        if self.party in payloads:
            raise ChannelError(f"{self.party} cannot send a message to itself")
        return self.channel._write_each(round, self.party, kind, payloads)

    def receive(self, sender: str, kind: str, round: int = 0, timeout: float | None = None) -> Any:
        """The payload; waits up to ``timeout`` (default: the channel's) for it to arrive."""
        key = self.channel.key(round, sender, self.party, kind)
        wait = self.channel.timeout if timeout is None else timeout
        with watchers.waiting_for(key):
            data = self.channel.transport.get(key, wait)
        try:
            _check_terms(key, data)
            return codec.loads(data)
        except codec.CodecError as error:
            raise ChannelError(f"refused the {key.describe()}: {error}") from error

    def relay(
        self,
        receivers: Sequence[str],
        kind: str,
        source_kind: str,
        senders: Sequence[str],
        round: int = 0,
    ) -> list[MessageRecord]:
        """Forward the ``source_kind`` messages of ``round`` that ``senders`` sent to this
        party, as one ``kind`` message to each receiver: each original's bytes with its
        sender's proof (:meth:`Transport.proof`), checked by :meth:`receive_relayed`.

        Each of them must have been received already. A receiver that has its copy keeps it
        (a retry sends nothing new): a proof may be randomised, so a rebuilt message could
        differ from the one sent."""
        store = self.channel.transport.store()
        pending = [
            r for r in receivers if store.find(self.channel.key(round, self.party, r, kind)) is None
        ]
        if not pending:
            return []
        transport, entries = self.channel.transport, {}
        for sender in senders:
            key = self.channel.key(round, sender, self.party, source_kind)
            data = transport.get(key, 0.0)
            entries[sender] = {"data": bytes(data), "proof": transport.proof(key)}
        return self.send_many(pending, kind, entries, round=round)

    def receive_relayed(
        self,
        relay: str,
        kind: str,
        source_kind: str,
        senders: Sequence[str],
        round: int = 0,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The payload of the ``source_kind`` message each of ``senders`` sent to ``relay``
        in ``round``, from ``relay``'s one ``kind`` message (:meth:`relay`). Each entry is
        checked as its sender's (the transport's proof, the job's terms) before it is read;
        one missing, altered, swapped or from another round, job or kind is refused with a
        :class:`RelayError` naming its sender."""
        entries = self.receive(relay, kind, round=round, timeout=timeout)
        if not isinstance(entries, dict):
            raise RelayError(f"refused {relay}'s {kind!r} message of round {round}: not a relay")
        out = {}
        for sender in senders:
            key = self.channel.key(round, sender, relay, source_kind)
            entry = entries.get(sender)
            if entry is None:
                raise RelayError(f"{relay}'s {kind!r} message lacks the {key.describe()}")
            try:
                data, proof = bytes(entry["data"]), bytes(entry["proof"])
                self.channel.transport.check_relayed(key, data, proof)
                _check_terms(key, data)
                out[sender] = codec.loads(data)
            except (ChannelError, codec.CodecError, KeyError, TypeError) as error:
                raise RelayError(
                    f"refused the {key.describe()} as relayed by {relay}: it is not what "
                    f"{sender} sent ({error})"
                ) from None
        return out

    def sent(self, receiver: str, kind: str, round: int = 0) -> Any | None:
        """What this party already sent under the key, or ``None``."""
        key = self.channel.key(round, self.party, receiver, kind)
        data = self.channel.transport.store().find(key)
        return None if data is None else codec.loads(data)

    def send_once(
        self, receiver: str, kind: str, make: Callable[[], Any], round: int = 0
    ) -> MessageRecord:
        """Send ``make()`` unless this party already sent under the key.

        For a retried step whose message is randomised (a fresh encryption or mask would be
        refused as a different payload): the message already sent stands, ``make`` is not
        called. Only correct when the retried step would send the same plaintext.
        """
        key = self.channel.key(round, self.party, receiver, kind)
        data = self.channel.transport.store().find(key)
        if data is None:
            return self.send(receiver, kind, make(), round=round)
        digest = _sha256(data)
        return MessageRecord(key.run, key.round, key.sender, receiver, kind, len(data), digest)
