"""A party's TLS credentials as files that may be renewed while the party runs, and the
endpoint's check of every caller by the one identity rule.

A renewed certificate (same CA, same name) is picked up by the endpoint at the next
handshake (gRPC asks :class:`CredentialFiles` through a certificate-configuration fetcher)
and by the client for the channels it opens next; connections already open keep their
session, so running jobs do not fail. A renewal that does not pass the endpoint's own
checks (:func:`federation.identity.check_own`) is not used: the last good credentials stay and
the refusal is logged once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import grpc

from federation import identity
from federation.party_config import PartyConfig

logger = logging.getLogger("privreg.endpoint")


class CredentialFiles:
    """The party's CA, certificate and key files, re-read (and re-checked) when they change.

    ``checked``: apply the endpoint's own checks (an endpoint); a client presents what it has
    and the peer judges it."""

    def __init__(self, config: PartyConfig, checked: bool = True) -> None:
        self.config, self.checked = config, checked
        self._lock = threading.Lock()
        self._refused: tuple[Any, ...] | None = None
        self._stamp = self._stat()
        self._own = self._check()
        self._ca = config.ca.read_bytes()

    def _stat(self) -> tuple[Any, ...]:
        stats = []
        for path in (self.config.ca, self.config.cert, self.config.key):
            try:
                info = os.stat(path)
                stats.append((info.st_ino, info.st_mtime_ns, info.st_size))
            except OSError:
                stats.append(None)
        return tuple(stats)

    def _check(self) -> identity.OwnCertificate:
        c = self.config
        if not self.checked:
            return identity.load_own(c.party, c.cert, c.key)
        return identity.check_own(c.party, c.ca, c.cert, c.key)

    def refresh(self) -> bool:
        """Re-read the files if they changed and pass the checks; True if they were swapped."""
        stamp = self._stat()
        with self._lock:
            if stamp == self._stamp or stamp == self._refused:
                return False
            try:
                own, ca = self._check(), self.config.ca.read_bytes()
            except (identity.IdentityError, OSError, ValueError, TypeError) as error:
                self._refused = stamp  # half-written files are retried at their next change
                logger.warning("kept the current certificate; the changed files: %s", error)
                return False
            self._own, self._ca, self._stamp = own, ca, stamp
        logger.warning("party %s now presents its renewed %s", own.party, own.summary())
        return True

    @property
    def own(self) -> identity.OwnCertificate:
        return self._own

    @property
    def ca(self) -> bytes:
        return self._ca

    def server_configuration(self) -> grpc.ServerCertificateConfiguration:
        own = self._own
        return grpc.ssl_server_certificate_configuration(
            [(_key_pem(own), own.chain_pem)], root_certificates=self._ca
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate follows the files: checked at each new handshake."""

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            return self.server_configuration() if self.refresh() else None

        return grpc.dynamic_ssl_server_credentials(
            self.server_configuration(), fetch, require_client_authentication=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        own = self._own
        return grpc.ssl_channel_credentials(self._ca, _key_pem(own), own.chain_pem)


def _key_pem(own: identity.OwnCertificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return own.key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def caller_of(context: grpc.ServicerContext) -> identity.Presented | None:
    """What the caller's TLS certificate presents (None without one)."""
    pems = context.auth_context().get("x509_pem_cert") or []
    if len(pems) != 1:
        return None
    try:
        return identity.presented(pems[0])
    except identity.IdentityError:
        return None


class CallerCheck(grpc.ServerInterceptor):
    """Every call, whatever its method: the caller's certificate must name a party by the one
    rule and match its pin; a refusal is logged with the caller's address and names."""

    def __init__(self, party: str, pins: dict[str, str]) -> None:
        self.party, self.pins = party, pins

    def intercept_service(
        self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        for kind, make in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ):
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return make(
                    self._checked(behaviour, details.method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler  # streaming requests: privreg serves none

    def _checked(self, behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            seen = caller_of(context)
            try:
                if seen is None:
                    raise identity.IdentityError("no readable client certificate")
                identity.check_pin(seen.party(), seen.fingerprint, self.pins)
            except identity.IdentityError as error:
                shown = seen.shown() if seen else "no certificate"
                logger.warning(
                    "party %s refused %s from %s presenting %s: %s",
                    *(self.party, method, context.peer(), shown, error),
                )
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"party {self.party} refuses the caller's certificate: {error}",
                )
            return behaviour(request, context)

        return run
