"""The network transport: each party keeps its own messages and peers fetch theirs over mTLS.

A party *sends* by writing the message into its own folder (its outbox, kept for replay). The
receiver *fetches* it from the sender's message endpoint, a gRPC service over mutual TLS:

* a party is the name its certificate gives by one rule, CN and DNS SAN equal
  (:mod:`federation.identity`), optionally pinned by fingerprint; the TLS layer checks that the
  caller's certificate chains to the configured CA, the endpoint checks the rule and the pin
  for every call (:class:`federation.tls_credentials.CallerCheck`), serves a message only to the
  party it is addressed to, and only its own messages, so a party reads only what is addressed
  to it;
* the receiver checks that the server's certificate names the sender it asked (TLS host-name
  check against the sender's name), and the sender signs each message's key and digest with
  its certificate's key; the receiver checks chain, rule, pin and signature before writing a
  byte, so a message in a party's inbox comes from the party whose certificate served it,
  never from a field a peer filled in: a party can send only as itself;
* each peer holds at most its share of the endpoint (:mod:`federation.endpoint_limits`), and a
  receiver refuses a message announced larger than its kind's cap
  (:mod:`federation.message_caps`) before writing it;
* the payload streams in 1 MiB chunks (gRPC's 4 MB message limit never applies); the receiver
  writes them to a temporary file, checks size and SHA-256, and persists the message in its own
  folder before using it. A key already holding other bytes is refused (nothing replaced);
* a peer that is down or has not sent yet is retried with backoff until the receive timeout;
  then :class:`MessageTimeoutError` names the peer, job, round and kind, and the last error.

The service's methods work on raw bytes. ``/privreg.Messages/Fetch``: the request and the
first response item are small dicts in the privreg codec, the rest are payload chunks.
``/privreg.Messages/Status``: a party's current status record of a job (federation.status),
served only to the parties that record names.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from federation import folder_watch, watchers
from federation.channel import (
    ChannelError,
    MessageFolder,
    MessageKey,
    MessageTimeoutError,
    PeerUnreachableError,
    check_name,
)
from federation.endpoint_limits import LimitExceededError, PeerGate, Ticket
from federation.identity import IdentityError, check_sender, sign, statement
from federation.party_config import PartyConfig
from federation.status import Proposal, ProposalRefusedError, status_parties
from federation.tls_credentials import CallerCheck, CredentialFiles, caller_of
from storage import codec

CHUNK = 1 << 20
LONG_POLL = 2.0  # seconds the endpoint holds a fetch for a message not sent yet
_METHOD = "/privreg.Messages/Fetch"
_GET_METHOD = "/privreg.Messages/Get"
INLINE = 4 * CHUNK  # a message up to this size comes in the one reply of a Get
_LENGTH = struct.Struct(">I")
_HEADER_BYTES = 64 * 1024  # size, digest, the sender's certificate chain and its signature
_STATUS_METHOD = "/privreg.Messages/Status"
_PROPOSE_METHOD = "/privreg.Messages/Propose"
STATUS_TIMEOUT = 2.0  # seconds a status question may take before the peer counts as unreachable
_FRAME_LIMIT = 8 * CHUNK
_OPTIONS = [
    ("grpc.max_send_message_length", _FRAME_LIMIT),
    ("grpc.max_receive_message_length", _FRAME_LIMIT),
]
# A partition stalls a connection rather than closing it: without keepalive, calls queue on it
# until TCP's retransmission timer, doubled at each loss, fires again after the link returns
# (up to a minute later after a minute's cut), and reconnects back off up to two minutes. A
# ping unanswered for 5 s closes the connection instead (gRPC 1.85 times a ping out by
# ping_timeout_ms, a minute by default, not by keepalive_timeout_ms alone), and a new one is
# tried at least every 5 s, so a peer is heard again within seconds of its link's return.
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS, RECONNECT_MAX_MS = 10_000, 5_000, 5_000
_CLIENT_OPTIONS = [
    *_OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
]
# gRPC sets SO_REUSEPORT by default, so a second endpoint on a taken port (a party started twice,
# or another service) would bind without error and the kernel would split peers' fetches
# between the two: a port is one party's alone, and a taken one is an error at start. The
# endpoint accepts its peers' keepalive pings (by default more than one in 5 minutes
# without data counts against the peer, which is then sent away).
_SERVER_OPTIONS = [
    *_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
# the server answered; retrying cannot help
_FATAL = {
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS,
}
_REFUSED_HINT = "; the peer may be refusing this party's certificate"
_TLS_FAILURES = ("handshake", "certificate", "verification", "ssl_error", "tsi_")
# the connection closed before any TLS reply (a TCP proxy in front of a peer whose own link is
# cut, a peer killed mid-handshake): retried, where a refused certificate ends the wait
_CLOSED_IN_HANDSHAKE = ("handshake read failed", "handshake write failed")


def _identity(context: grpc.ServicerContext) -> str | None:
    """The caller's party by the one rule (its certificate's CN and DNS SAN equal), or None."""
    seen = caller_of(context)
    try:
        return seen.party() if seen is not None else None
    except IdentityError:
        return None


class MessageService:
    """The server side: streams a party's own sent messages to their receivers only."""

    def __init__(self, config: PartyConfig, files: CredentialFiles | None = None) -> None:
        self.party = config.party
        self.folder = MessageFolder(config.root)
        self.on_proposal: Callable[[str, Proposal], str] | None = None  # the party service's
        self.files = files or CredentialFiles(config)
        self.limits = config.limits
        self.gate = PeerGate(config.party, config.limits)

    def _admit(self, request: bytes, context: grpc.ServicerContext) -> tuple[MessageKey, float]:
        """The asked key and long-poll seconds, if the caller is the message's receiver and
        this party its sender (else the call is aborted)."""
        caller = _identity(context)
        try:
            fields = codec.loads(request, codec.Limits(max_bytes=4096))
            wait = min(float(fields.pop("wait", 0.0)), LONG_POLL)
            key = MessageKey(**fields)
        except (codec.CodecError, TypeError, ValueError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {error}")
        if caller is None or caller != key.receiver:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"party {self.party} refuses: {caller!r} asked for the {key.describe()}, "
                f"which is addressed to {key.receiver}",
            )
        if key.sender != self.party:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"party {self.party} serves only its own messages, not the {key.describe()}",
            )
        return key, wait

    def _opened(
        self, key: MessageKey, wait: float, context: grpc.ServicerContext
    ) -> tuple[Any, Ticket]:
        """The message's file (after a long poll if it is not sent yet, its size reserved)
        and the caller's ticket; aborts the call on a limit or a message not sent yet."""
        try:
            ticket = self.gate.open(key.receiver)
        except LimitExceededError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        context.add_callback(ticket.release)  # whatever ends the call frees the peer's share
        try:
            return self._open(key, wait, ticket, context), ticket
        except LimitExceededError as error:
            ticket.release()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except FileNotFoundError:
            ticket.release()
            context.abort(grpc.StatusCode.NOT_FOUND, f"not sent yet: the {key.describe()}")

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Any:
        """The message as a stream (header, then 1 MiB chunks): for one too large for
        :meth:`get`'s single reply."""
        key, wait = self._admit(request, context)
        handle, ticket = self._opened(key, wait, context)
        return self._stream(handle, key, ticket, context)

    def get(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The message in one reply (header and payload), or only ``{"stream": True}`` when it
        is larger than :data:`INLINE` (the receiver then asks :meth:`fetch`).

        Why a unary call: a client's streaming call starts a thread per call in gRPC's
        synchronous API (~4 ms here), and nearly every message of a round is small."""
        key, wait = self._admit(request, context)
        handle, ticket = self._opened(key, wait, context)
        try:
            with handle:
                if os.fstat(handle.fileno()).st_size > INLINE:
                    return _frame({"stream": True})
                data = handle.read()
            return _frame(self._header(key, len(data), hashlib.sha256(data).hexdigest()), data)
        finally:
            ticket.release()

    def _header(self, key: MessageKey, size: int, sha256: str) -> dict[str, Any]:
        """Size, digest, this party's certificate and its signature over the message's key,
        size and digest: what the receiver checks before it writes a byte."""
        own = self.files.own
        proof = sign(own, statement(vars(key), size, sha256))
        return {"size": size, "sha256": sha256, "cert": own.chain_pem, "proof": proof}

    def _open(
        self, key: MessageKey, wait: float, ticket: Ticket, context: grpc.ServicerContext
    ) -> Any:
        """The message's file, after a long poll if it is not sent yet; its size reserved.
        The long poll is answered the moment the sender links the file into place (the
        folder's watch wakes it, :mod:`federation.folder_watch`)."""
        path = self.folder.path(key)
        if not path.exists() and wait > 0:
            ticket.start_long_poll()
            try:
                folder_watch.wait_for(path, wait, context.is_active)
            finally:
                ticket.end_long_poll()
        handle = open(path, "rb")  # noqa: SIM115 (closed by the caller)
        try:
            ticket.reserve(os.fstat(handle.fileno()).st_size)
        except LimitExceededError:
            handle.close()
            raise
        return handle

    @contextlib.contextmanager
    def _slot(self, caller: str | None, context: grpc.ServicerContext) -> Iterator[None]:
        """A fetch slot of ``caller``'s for a unary call (Status, Propose), so they count
        against its share like its fetches; beyond it the call is refused at once."""
        try:
            ticket = self.gate.open(str(caller))
        except LimitExceededError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        try:
            yield
        finally:
            ticket.release()

    def status(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """This party's status record of a job, for a party of that job only."""
        caller = _identity(context)
        with self._slot(caller, context):
            return self._status(caller, request, context)

    def _status(self, caller: str | None, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            run = check_name(codec.loads(request, codec.Limits(max_bytes=1024))["run"], "job")
        except (codec.CodecError, KeyError, TypeError, ValueError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {error}")
        data = self.folder.read_status(run, self.party)
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{self.party} has no status for job {run}")
        if caller not in status_parties(data):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"party {self.party} refuses: {caller!r} is not a party of job {run}",
            )
        return data

    def propose(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A peer proposes a job run: this party's service decides (``on_proposal``) and
        answers in one line; a refusal is PERMISSION_DENIED with the rule that refused."""
        caller = _identity(context)
        with self._slot(caller, context):
            return self._propose(caller, request, context)

    def _propose(self, caller: str | None, request: bytes, context: grpc.ServicerContext) -> bytes:
        if self.on_proposal is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"party {self.party} takes no proposals (its endpoint runs no party service)",
            )
        try:
            fields = codec.loads(request, codec.Limits(max_bytes=4096))
            proposal = Proposal(str(fields["job_file"]), str(fields.get("run", "")))
        except (codec.CodecError, KeyError, TypeError, ValueError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad proposal: {error}")
        try:
            return codec.dumps({"answer": self.on_proposal(str(caller), proposal)})
        except ProposalRefusedError as refusal:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(refusal))

    def _stream(
        self, handle: Any, key: MessageKey, ticket: Ticket, context: grpc.ServicerContext
    ) -> Any:
        """The header (:meth:`_header`), then the payload; cancelled after
        ``stream_seconds`` (a peer reading slowly holds a worker)."""
        disarm = _REAPER.after(self.limits.stream_seconds, context.cancel)
        try:
            with handle:
                digest = hashlib.sha256()
                while chunk := handle.read(CHUNK):
                    digest.update(chunk)
                yield codec.dumps(self._header(key, handle.tell(), digest.hexdigest()))
                handle.seek(0)
                while chunk := handle.read(CHUNK):
                    yield chunk
        finally:
            disarm()
            ticket.release()


def _frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """A :meth:`MessageService.get` reply: the header's length, the header, the payload."""
    encoded = codec.dumps(header)
    return _LENGTH.pack(len(encoded)) + encoded + payload


def _unframe(reply: bytes) -> tuple[dict[str, Any], memoryview]:
    view = memoryview(reply)
    (length,) = _LENGTH.unpack_from(view)
    if length > _HEADER_BYTES or _LENGTH.size + length > len(view):
        raise ValueError(f"a reply header of {length} bytes")
    end = _LENGTH.size + length
    header = codec.loads(view[_LENGTH.size : end], codec.Limits(max_bytes=_HEADER_BYTES))
    return header, view[end:]


class _Reaper:
    """One thread that calls each registered action once its time has come, unless disarmed.

    Why: a thread per stream only to cancel it late cost ~4 ms to start on every fetch."""

    def __init__(self) -> None:
        self._due: list[list[Any]] = []  # [when, order, action or None], a heap
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def after(self, seconds: float, action: Callable[[], Any]) -> Callable[[], None]:
        entry = [time.monotonic() + seconds, next(self._order), action]
        with self._changed:
            heapq.heappush(self._due, entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stream-limit", daemon=True)
                self._thread.start()
            self._changed.notify()

        def disarm() -> None:
            entry[2] = None

        return disarm

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._due and self._due[0][2] is None:
                    heapq.heappop(self._due)
                if not self._due:
                    self._changed.wait(60.0)
                    continue
                delay = self._due[0][0] - time.monotonic()
                if delay > 0:
                    self._changed.wait(delay)
                    continue
                action = heapq.heappop(self._due)[2]
            if action is not None:
                action()


_REAPER = _Reaper()


def serve(
    config: PartyConfig,
    max_workers: int | None = None,
    check_own: bool = True,
    on_proposal: Callable[[str, Proposal], str] | None = None,
) -> tuple[grpc.Server, int]:
    """Start the party's message endpoint; returns the server and the port it listens on.

    The endpoint first checks its own credentials (:func:`federation.identity.check_own`;
    ``check_own=False`` only to play an impostor in tests) and follows renewed files. Its
    workers default to every configured peer's share and spares (``limits.workers``).
    """
    files = CredentialFiles(config, checked=check_own)
    credentials = files.server_credentials()
    service = MessageService(config, files)
    service.on_proposal = on_proposal
    handler = grpc.method_handlers_generic_handler(
        "privreg.Messages",
        {
            "Fetch": grpc.unary_stream_rpc_method_handler(service.fetch),
            "Get": grpc.unary_unary_rpc_method_handler(service.get),
            "Status": grpc.unary_unary_rpc_method_handler(service.status),
            "Propose": grpc.unary_unary_rpc_method_handler(service.propose),
        },
    )
    workers = max_workers or config.limits.workers(len(config.peers))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        interceptors=[CallerCheck(config.party, config.pins)],
        options=_SERVER_OPTIONS,
        maximum_concurrent_rpcs=workers * 8,  # beyond: RESOURCE_EXHAUSTED, not a queue
    )
    server.add_generic_rpc_handlers((handler,))
    try:
        port = server.add_secure_port(config.listen, credentials)
    except RuntimeError:  # grpcio raises on a failed bind (older versions returned 0)
        port = 0
    if port == 0:
        raise ChannelError(
            f"party {config.party}: cannot listen on {config.listen}"
            " (the address is taken, perhaps by this party's endpoint already running)"
        )
    server.start()
    return server, port


class GrpcTransport:
    """The client side, used by one party's steps: outbox on disk, fetch from peers."""

    def __init__(self, config: PartyConfig, limits: codec.Limits = codec.MESSAGE) -> None:
        self.config = config
        self.party: str | None = config.party
        self.folder = MessageFolder(config.root)
        self.limits = limits
        self.files = CredentialFiles(config, checked=False)  # the peer judges what it presents
        self._channels: dict[str, grpc.Channel] = {}
        self._retired: list[grpc.Channel] = []  # channels of replaced credentials
        self._lock = threading.Lock()
        self._intact: set[MessageKey] = set()  # received copies stored or checked by this process
        self._fetching: dict[MessageKey, threading.Lock] = {}

    def store(self) -> MessageFolder:
        return self.folder

    def put(self, key: MessageKey, data: bytes) -> None:
        if key.sender != self.party:
            raise ChannelError(f"party {self.party} cannot send as {key.sender}")
        self.folder.put(key, data)

    def put_all(self, items: Sequence[tuple[MessageKey, bytes]]) -> None:
        if any(key.sender != self.party for key, _ in items):
            raise ChannelError(f"party {self.party} can send only as itself")
        self.folder.put_all(items)

    def _local(self, key: MessageKey) -> memoryview | None:
        """The stored copy, if this process stored it or it matches its note (a copy torn by
        a crash of the machine, or without a note, is fetched again from its sender)."""
        path = self.folder.path(key)
        if key not in self._intact:
            if not path.exists() or not self.folder.received_intact(key):
                return None
            self._intact.add(key)
        return _mapped(path)

    def get(self, key: MessageKey, timeout: float) -> bytes | memoryview:
        if key.receiver != self.party:
            raise ChannelError(f"party {self.party} cannot read the {key.describe()}")
        if (data := self._local(key)) is not None:
            return data
        with self._lock:
            fetching = self._fetching.setdefault(key, threading.Lock())
        # one fetch of a key at a time: a second receiver of it (a round's check while a
        # prefetch holds the long poll) waits for that one instead of asking the peer again
        if not fetching.acquire(timeout=max(timeout, 0.0)):
            raise MessageTimeoutError(
                f"party {self.party} gave up after {timeout:g} s waiting for the "
                f"{key.describe()} (another wait of this process is fetching it)"
            )
        try:
            if (data := self._local(key)) is not None:
                return data
            return self._get(key, timeout)
        finally:
            fetching.release()
            if key in self._intact:
                with self._lock:
                    self._fetching.pop(key, None)

    def _get(self, key: MessageKey, timeout: float) -> bytes | memoryview:
        address = self.config.address_of(key.sender)
        deadline, pause, last = time.monotonic() + timeout, 0.05, "none"
        while True:
            watchers.check_peers()  # a peer's failure ends the wait, not the timeout
            try:
                return self._fetch(key, deadline)
            except _NotYetError as retry:  # the peer held the fetch: ask again at once
                last, pause = str(retry), 0.05
                if deadline - time.monotonic() > 0:
                    continue
            except _RetryError as retry:
                last = str(retry)
            remaining = deadline - time.monotonic()
            if remaining <= 0 and watchers.patient(key):  # alive, busy with an earlier job
                deadline = time.monotonic() + timeout
                continue
            if remaining <= 0:
                raise MessageTimeoutError(
                    f"party {self.party} gave up after {timeout:g} s waiting for the "
                    f"{key.describe()} (peer {key.sender} at {address}; last error: {last}"
                    + (_REFUSED_HINT if "Socket closed" in last else "")
                    + ")"
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 1.0)

    def proof(self, key: MessageKey) -> bytes:
        """The sender's certificate and signature, as noted when this party received the
        message (:meth:`_store`)."""
        proof = self.folder.received_proof(key)
        if not proof:
            raise ChannelError(f"party {self.party} holds no proof of the {key.describe()}")
        return proof

    def check_relayed(self, key: MessageKey, data: bytes, proof: bytes) -> None:
        """``key.sender``'s certificate (the chain, rule and pin) signed ``key`` with the size
        and digest of ``data``, within the kind's cap: the checks of a fetched message."""
        try:
            header = codec.loads(proof, codec.Limits(max_bytes=_HEADER_BYTES))
        except codec.CodecError as error:
            raise ChannelError(f"a bad proof ({error})") from None
        self._check_header(key, header, len(data), hashlib.sha256(data).hexdigest())

    def publish_status(self, run: str, party: str, data: bytes) -> None:
        if party != self.party:
            raise ChannelError(f"party {self.party} cannot publish {party}'s status")
        self.folder.write_status(run, party, data)

    def propose(self, peer: str, proposal: Proposal) -> str:
        """Propose a job run to ``peer``'s party service; its one-line answer, or
        :class:`ProposalRefusedError` with its reason."""
        call = self._channel(peer).unary_unary(_PROPOSE_METHOD)
        request = codec.dumps({"job_file": proposal.job_file, "run": proposal.run})
        try:
            reply = codec.loads(call(request, timeout=30), codec.Limits(max_bytes=4096))
        except grpc.RpcError as error:
            refused = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
            if error.code() in refused:
                raise ProposalRefusedError(f"{peer} refused: {error.details()}") from None
            busy = error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # names the limit
            raise PeerUnreachableError(
                f"peer {peer} at {self.config.address_of(peer)}: {error.code().name}"
                + (f": {error.details()}" if busy else "")
            ) from None
        return str(reply["answer"])

    def peer_status(self, run: str, peer: str) -> bytes | None:
        call = self._channel(peer).unary_unary(_STATUS_METHOD)
        try:
            return call(codec.dumps({"run": run}), timeout=STATUS_TIMEOUT)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if error.code() in _FATAL:
                detail = error.details()
                raise ChannelError(f"peer {peer} refused the status question: {detail}") from None
            raise PeerUnreachableError(
                f"peer {peer} at {self.config.address_of(peer)}: {error.code().name}"
            ) from None

    def _channel(self, peer: str) -> grpc.Channel:
        with self._lock:
            if self.files.refresh():  # renewed: new fetches use it, running ones finish
                self._retired += self._channels.values()
                self._channels = {}
            if peer not in self._channels:
                credentials = self.files.channel_credentials()
                # the server's certificate must name the peer we ask: TLS checks it
                options = [*_CLIENT_OPTIONS, ("grpc.ssl_target_name_override", peer)]
                self._channels[peer] = grpc.secure_channel(
                    self.config.address_of(peer), credentials, options=options
                )
            return self._channels[peer]

    def _request(self, key: MessageKey, deadline: float) -> tuple[bytes, float]:
        wait = max(min(deadline - time.monotonic(), LONG_POLL), 0.0)
        fields = {"run": key.run, "round": key.round, "sender": key.sender}
        fields.update(receiver=key.receiver, kind=key.kind, wait=wait)
        return codec.dumps(fields), wait

    def _fetch(self, key: MessageKey, deadline: float) -> bytes | memoryview:
        """One ``Get`` (a long poll up to :data:`LONG_POLL`): the message in one reply, checked
        and stored; a message larger than :data:`INLINE` is streamed (:meth:`_fetch_stream`)."""
        request, wait = self._request(key, deadline)
        call = self._channel(key.sender).unary_unary(_GET_METHOD)
        try:
            reply = call(request, timeout=wait + 60)
        except grpc.RpcError as error:
            raise self._classify(key, error) from None
        try:
            header, payload = _unframe(reply)
            if header.get("stream"):
                return self._fetch_stream(key, deadline)
            size, expected = int(header["size"]), str(header["sha256"])
        except (codec.CodecError, KeyError, TypeError, ValueError, struct.error) as error:
            raise ChannelError(f"refused the {key.describe()}: bad header ({error!r})") from None
        self._check_header(key, header, size, expected)
        if len(payload) != size or hashlib.sha256(payload).hexdigest() != expected:
            raise ChannelError(
                f"refused the {key.describe()}: {len(payload)} bytes received, {size} "
                "announced, or the SHA-256 does not match; nothing stored"
            )
        tmp = self.folder.staging(key)
        try:
            tmp.write_bytes(payload)
            self._store(key, tmp, header)
        finally:
            tmp.unlink(missing_ok=True)
        return bytes(payload)

    def _store(self, key: MessageKey, tmp: Path, header: dict[str, Any]) -> None:
        """Put a checked copy in place, unsynced (:meth:`MessageFolder.note_received`, with
        the sender's certificate and signature: its proof if this party relays the copy); a
        stored copy that failed its check is replaced by the sender's."""
        proof = codec.dumps({"cert": bytes(header["cert"]), "proof": bytes(header["proof"])})
        self.folder.note_received(key, int(header["size"]), str(header["sha256"]), proof)
        path = self.folder.path(key)
        if path.exists() and key not in self._intact and not self.folder.received_intact(key):
            os.replace(tmp, path)  # torn by a crash: the sender's signed copy takes its place
        else:
            self.folder.commit_received(key, tmp)
        self._intact.add(key)

    def _fetch_stream(self, key: MessageKey, deadline: float) -> bytes | memoryview:
        """The message as a stream of 1 MiB chunks, written to a temporary file as it comes."""
        request, _ = self._request(key, deadline)
        call = self._channel(key.sender).unary_stream(_METHOD)
        stream = call(request, timeout=max(deadline - time.monotonic(), 0) + 300)
        tmp: Path | None = None
        try:
            header = codec.loads(next(stream), codec.Limits(max_bytes=_HEADER_BYTES))
            size, expected = int(header["size"]), str(header["sha256"])
            self._check_header(key, header, size, expected)
            tmp = self.folder.staging(key)
            digest, received = hashlib.sha256(), 0
            with open(tmp, "wb") as handle:
                for chunk in stream:
                    received += len(chunk)
                    if received > size:
                        break
                    digest.update(chunk)
                    handle.write(chunk)
            if received != size or digest.hexdigest() != expected:
                raise ChannelError(
                    f"refused the {key.describe()}: {received} bytes received, {size} announced, "
                    "or the SHA-256 does not match; nothing stored"
                )
            self._store(key, tmp, header)
            tmp = None
        except grpc.RpcError as error:
            raise self._classify(key, error) from None
        except (StopIteration, codec.CodecError, KeyError, TypeError, ValueError) as error:
            raise ChannelError(f"refused the {key.describe()}: bad header ({error!r})") from None
        finally:
            stream.cancel()
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        data = _mapped(self.folder.path(key))
        assert data is not None
        return data

    def _check_header(
        self, key: MessageKey, header: dict[str, Any], size: int, expected: str
    ) -> None:
        """Before a byte is written: the size within the kind's cap, and the sender's proof."""
        cap, rule = self.config.caps.cap(key.kind)
        if self.limits.max_bytes < cap:
            cap, rule = self.limits.max_bytes, "this transport's codec limit"
        if size > cap:
            raise ChannelError(
                f"refused the {key.describe()}: {size} bytes exceed the cap of {cap} for "
                f"its kind ({rule}); nothing written"
            )
        try:
            check_sender(
                key.sender,
                bytes(header["cert"]),
                bytes(header["proof"]),
                statement(vars(key), size, expected),
                self.files.ca,
                self.config.pins,
            )
        except IdentityError as error:
            raise ChannelError(
                f"party {self.party} refused the {key.describe()}: {error}"
            ) from None

    def _classify(self, key: MessageKey, error: grpc.RpcError) -> Exception:
        code, details = error.code(), error.details() or ""
        where = f"peer {key.sender} at {self.config.address_of(key.sender)}"
        if code in _FATAL:
            return ChannelError(f"{where} refused: {details}")
        if code == grpc.StatusCode.UNAVAILABLE and any(
            marker in details.lower() for marker in _CLOSED_IN_HANDSHAKE
        ):  # no TLS answer came at all: the link or the peer went, not a certificate
            return _RetryError(f"{code.name}: {details}")
        if (
            code == grpc.StatusCode.UNAVAILABLE
            and "failed to connect" in details
            and "socket closed" in details.lower()
        ):  # the peer closed the TLS handshake: it refuses this party's certificate
            return ChannelError(
                f"party {self.party}: {where} refused this party's certificate in the TLS "
                f"handshake (signed by a CA the peer does not trust, or expired?): {details}"
            )
        if code == grpc.StatusCode.UNAVAILABLE and any(
            marker in details.lower() for marker in _TLS_FAILURES
        ):
            return ChannelError(
                f"party {self.party}: mutual TLS with {where} failed (a certificate from "
                f"another CA, or one not issued to {key.sender}?): {details}"
            )
        if code == grpc.StatusCode.NOT_FOUND:
            return _NotYetError(f"{code.name}: {details}")
        return _RetryError(f"{code.name}: {details}")

    def close(self) -> None:
        with self._lock:
            for channel in [*self._channels.values(), *self._retired]:
                channel.close()
            self._channels.clear()
            self._retired.clear()


def _mapped(path: Path) -> memoryview | None:
    """A stored message as a read-only map of its file, or None if it is not there.

    The codec decodes from the map, so the process holds the decoded value (and, for lists
    of big integers, one transient copy of their bytes) but never the whole message as a
    second buffer; the file's pages are the page cache's, read as the decoder walks them.
    """
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
    except FileNotFoundError:
        return None


class _RetryError(Exception):
    """The peer is not reachable or has not sent yet: try again until the timeout."""


class _NotYetError(_RetryError):
    """The peer answered that the message is not sent yet, after holding the fetch a while."""


_TRANSPORTS: dict[str, GrpcTransport] = {}


def transport_for(config: PartyConfig) -> GrpcTransport:
    """One transport (and so one set of peer connections) per party configuration."""
    with _SHARED_LOCK:
        if config.party not in _TRANSPORTS or _TRANSPORTS[config.party].config != config:
            _TRANSPORTS[config.party] = GrpcTransport(config)
        return _TRANSPORTS[config.party]


_SHARED_LOCK = threading.Lock()
