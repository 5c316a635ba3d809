"""The network transport: each party keeps its own messages and peers fetch theirs over mTLS.

A party *sends* by writing the message into its own folder (its outbox, kept for replay). The
receiver *fetches* it from the sender's message endpoint, a gRPC service over mutual TLS:

* the caller's identity is the name in its client certificate (the TLS layer checks that a
  certificate chains to the configured CA); the endpoint serves a message only to the party it
  is addressed to, and only its own messages, so a party reads only what is addressed to it;
* the receiver checks that the server's certificate names the sender it asked (TLS host-name
  check against the sender's name), so a message in a party's inbox comes from the party whose
  certificate served it, never from a field a peer filled in: a party can send only as itself;
* the payload streams in 1 MiB chunks (gRPC's 4 MB message limit never applies); the receiver
  writes them to a temporary file, checks size and SHA-256, and persists the message in its own
  folder before using it. A key already holding other bytes is refused (nothing replaced);
* a peer that is down or has not sent yet is retried with backoff until the receive timeout;
  then :class:`MessageTimeoutError` names the peer, job, round and kind, and the last error.

The service has one method (``/privreg.Messages/Fetch``) on raw bytes: the request and the
first response item are small dicts in the privreg codec, the rest are payload chunks.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from storage import codec
from storage.channel import (
    ChannelError,
    MessageFolder,
    MessageKey,
    MessageTimeoutError,
)
from storage.party_config import PartyConfig

CHUNK = 1 << 20
LONG_POLL = 2.0  # seconds the endpoint holds a fetch for a message not sent yet
_METHOD = "/privreg.Messages/Fetch"
_FRAME_LIMIT = 8 * CHUNK
_OPTIONS = [
    ("grpc.max_send_message_length", _FRAME_LIMIT),
    ("grpc.max_receive_message_length", _FRAME_LIMIT),
]
# gRPC sets SO_REUSEPORT by default, so a second endpoint on a taken port (a party started twice,
# or another service) would bind without error and the kernel would split peers' fetches
# between the two: a port is one party's alone, and a taken one is an error at start.
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.so_reuseport", 0)]
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


def _identity(context: grpc.ServicerContext) -> str | None:
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if len(names) == 1 else None


def _credentials_files(config: PartyConfig) -> tuple[bytes, bytes, bytes]:
    return config.ca.read_bytes(), config.key.read_bytes(), config.cert.read_bytes()


class MessageService:
    """The server side: streams a party's own sent messages to their receivers only."""

    def __init__(self, config: PartyConfig) -> None:
        self.party = config.party
        self.folder = MessageFolder(config.root)

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Any:
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
        path = self.folder.path(key)
        deadline = time.monotonic() + wait  # a long poll: answer as soon as the message exists
        while not path.exists() and time.monotonic() < deadline and context.is_active():
            time.sleep(0.005)
        try:
            handle = open(path, "rb")  # noqa: SIM115 (closed by the generator below)
        except FileNotFoundError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"not sent yet: the {key.describe()}")
        return self._stream(handle)

    @staticmethod
    def _stream(handle: Any) -> Any:
        with handle:
            digest = hashlib.sha256()
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
            yield codec.dumps({"size": handle.tell(), "sha256": digest.hexdigest()})
            handle.seek(0)
            while chunk := handle.read(CHUNK):
                yield chunk


def serve(config: PartyConfig, max_workers: int = 8) -> tuple[grpc.Server, int]:
    """Start the party's message endpoint; returns the server and the port it listens on."""
    ca, key, cert = _credentials_files(config)
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )
    service = MessageService(config)
    handler = grpc.method_handlers_generic_handler(
        "privreg.Messages",
        {"Fetch": grpc.unary_stream_rpc_method_handler(service.fetch)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=_SERVER_OPTIONS
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
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def store(self) -> MessageFolder:
        return self.folder

    def put(self, key: MessageKey, data: bytes) -> None:
        if key.sender != self.party:
            raise ChannelError(f"party {self.party} cannot send as {key.sender}")
        self.folder.put(key, data)

    def get(self, key: MessageKey, timeout: float) -> bytes:
        if key.receiver != self.party:
            raise ChannelError(f"party {self.party} cannot read the {key.describe()}")
        if (data := self.folder.find(key)) is not None:
            return data
        address = self.config.address_of(key.sender)
        deadline, pause, last = time.monotonic() + timeout, 0.05, "none"
        while True:
            try:
                return self._fetch(key, deadline)
            except _NotYetError as retry:  # the peer held the fetch: ask again at once
                last, pause = str(retry), 0.05
                if deadline - time.monotonic() > 0:
                    continue
            except _RetryError as retry:
                last = str(retry)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MessageTimeoutError(
                    f"party {self.party} gave up after {timeout:g} s waiting for the "
                    f"{key.describe()} (peer {key.sender} at {address}; last error: {last}"
                    + (_REFUSED_HINT if "Socket closed" in last else "")
                    + ")"
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 1.0)

    def _channel(self, peer: str) -> grpc.Channel:
        with self._lock:
            if peer not in self._channels:
                ca, key, cert = _credentials_files(self.config)
                credentials = grpc.ssl_channel_credentials(ca, key, cert)
                # the server's certificate must name the peer we ask: TLS checks it
                options = [*_OPTIONS, ("grpc.ssl_target_name_override", peer)]
                self._channels[peer] = grpc.secure_channel(
                    self.config.address_of(peer), credentials, options=options
                )
            return self._channels[peer]

    def _fetch(self, key: MessageKey, deadline: float) -> bytes:
        request = codec.dumps(
            {
                "run": key.run,
                "round": key.round,
                "sender": key.sender,
                "receiver": key.receiver,
                "kind": key.kind,
                "wait": max(min(deadline - time.monotonic(), LONG_POLL), 0.0),
            }
        )
        call = self._channel(key.sender).unary_stream(_METHOD)
        stream = call(request, timeout=max(deadline - time.monotonic(), 0) + 300)
        tmp: Path | None = None
        try:
            header = codec.loads(next(stream), codec.Limits(max_bytes=4096))
            size, expected = int(header["size"]), str(header["sha256"])
            if size > self.limits.max_bytes:
                raise ChannelError(
                    f"refused the {key.describe()}: {size} bytes exceed the cap of "
                    f"{self.limits.max_bytes}"
                )
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
            self.folder.commit(key, tmp)
            tmp = None
        except grpc.RpcError as error:
            raise self._classify(key, error) from None
        except (StopIteration, codec.CodecError, KeyError, TypeError, ValueError) as error:
            raise ChannelError(f"refused the {key.describe()}: bad header ({error!r})") from None
        finally:
            stream.cancel()
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        data = self.folder.find(key)
        assert data is not None
        return data

    def _classify(self, key: MessageKey, error: grpc.RpcError) -> Exception:
        code, details = error.code(), error.details() or ""
        where = f"peer {key.sender} at {self.config.address_of(key.sender)}"
        if code in _FATAL:
            return ChannelError(f"{where} refused: {details}")
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
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


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
