"""Secrets that live as long as one job: sealed under a per-job key file shredded at its end.

A job's secrets (Paillier factors, PSI scalars, secure-aggregation keys and seeds) must be
gone from the party's folder once the job ends. Deleting a row from a DuckDB database does not
do that: the bytes stay in free pages, in the write-ahead log and in any copy of the file. So
a secret never enters the database in the clear. It is stored there *sealed* (ChaCha20-Poly1305)
under a 32-byte key that lives in its own file, one per job and party, beside the database:
``<database>.secrets/<digest of the scope>.key``, in a 0700 folder, created 0600 with
``O_EXCL`` (never through a symlink), read only when nobody else may read it. At the job's end
:meth:`JobSecrets.destroy` overwrites that file with zeros, syncs it and unlinks it; what the
database and its backups still hold is ciphertext under a key that no longer exists.

Why this rather than one file per secret: the sealed values keep the database's transactions
(a key pair, a secure-aggregation step's state and its replay guards commit or roll back
together, and a restarted process finds them exactly as before a kill -9), and there is one
small file per job to destroy instead of every copy of every value. The limit: overwriting
a file in place does not reach blocks a copy-on-write or journaling file system, or an SSD's
wear levelling, keeps elsewhere, and a backup taken *during* the job holds the key too. The
key is 32 bytes in one file, which makes it as small a target as such media allow; the
The threat model (docs/threat-model.md) says what remains.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from phe.paillier import PaillierPrivateKey, PaillierPublicKey

from core.paillier.keys import generate_keypair
from storage import codec
from storage.artifacts import Artifact, ArtifactStore
from storage.party_store import PartyStore, private_dirs

KEY_BYTES = 32
_NONCE_BYTES = 12
_SEALED_KIND = "sealed-secret"
_MISSING = object()


class SecretGoneError(KeyError):
    """A sealed secret whose job key was destroyed (the job ended) or is unreadable."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "secret gone"


class SecretFileError(PermissionError):
    """A key file others may read, or one that is not a regular file of this user."""


def secrets_folder(database: str | os.PathLike[str]) -> Path:
    """Where the owner of ``database`` keeps its job keys: ``<database>.secrets``."""
    path = Path(database)
    return path.with_name(path.name + ".secrets")


def shred(path: Path) -> bool:
    """Overwrite ``path`` with zeros, sync, unlink and sync its folder; False if it is absent."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        os.pwrite(fd, bytes(os.fstat(fd).st_size), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    _sync_folder(path.parent)
    return True


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class JobSecrets:
    """The sealing key of one job (``scope``, e.g. ``"vertical/<job id>"``) at one party."""

    database: Path
    scope: str

    @classmethod
    def of(cls, store: PartyStore, scope: str) -> JobSecrets:
        return cls(Path(store.path), scope)

    @property
    def path(self) -> Path:
        digest = hashlib.sha256(self.scope.encode()).hexdigest()[:32]
        return secrets_folder(self.database) / f"{digest}.key"

    def exists(self) -> bool:
        return self.path.exists()

    def _read(self) -> bytes | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077 or info.st_uid != os.getuid():
                raise SecretFileError(
                    f"job key {self.path} is not a private file of this user (mode "
                    f"{stat.filemode(info.st_mode)}); refusing to use it"
                )
            key = os.pread(fd, KEY_BYTES + 1, 0)
        finally:
            os.close(fd)
        if len(key) != KEY_BYTES or not any(key):
            raise SecretGoneError(f"job key {self.path} is damaged or was wiped")
        return key

    def _create(self) -> bytes:
        """A fresh key, published atomically: written to a private temporary file, then
        hard-linked to its name (which fails if another process won the race)."""
        folder = self.path.parent
        private_dirs(folder)
        temporary = folder / f".{self.path.name}.{secrets.token_hex(8)}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, self.path)
        except FileExistsError:
            shred(temporary)  # another writer's key stands; ours was never used
        else:
            temporary.unlink()
            _sync_folder(folder)
        key = self._read()
        assert key is not None
        return key

    def seal(self, value: Any, label: str) -> bytes:
        """``value`` encrypted under this job's key (created on first use), bound to ``label``
        (e.g. the artifact key it is stored under) so sealed values cannot be swapped."""
        key = self._read() or self._create()
        nonce = os.urandom(_NONCE_BYTES)
        plain = codec.dumps(value, codec.ARTIFACT)
        return nonce + ChaCha20Poly1305(key).encrypt(nonce, plain, self._aad(label))

    def open(self, sealed: bytes, label: str) -> Any:
        """The value :meth:`seal` sealed under ``label``; :class:`SecretGoneError` once the
        job's key is destroyed (or when it was sealed under an earlier, destroyed key)."""
        key = self._read()
        if key is None:
            raise SecretGoneError(f"the secrets of {self.scope} were destroyed (its job ended)")
        try:
            plain = ChaCha20Poly1305(key).decrypt(
                sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], self._aad(label)
            )
        except InvalidTag:
            raise SecretGoneError(
                f"{label} was sealed under another key of {self.scope} (an earlier one, "
                "destroyed) or was altered"
            ) from None
        return codec.loads(plain, codec.ARTIFACT)

    def _aad(self, label: str) -> bytes:
        return f"privreg-secret\0{self.scope}\0{label}".encode()

    def destroy(self) -> bool:
        """Shred the job's key: every value sealed under it is unreadable from now on."""
        return shred(self.path)


class SealedArtifacts:
    """Artifacts of one party whose values are sealed under one job's key.

    The same keys and transactions as :class:`ArtifactStore`; the database only ever holds
    the sealed bytes."""

    def __init__(self, store: PartyStore, scope: str) -> None:
        self.artifacts = ArtifactStore(store)
        self.secrets = JobSecrets.of(store, scope)

    def put(self, key: str, value: Any, con: Any = None) -> None:
        self.artifacts.put_many([self.item(key, value)], con=con)

    def item(self, key: str, value: Any) -> Artifact:
        """``value`` sealed under ``key``, to write with others (:meth:`ArtifactStore.put_many`)."""
        return Artifact(key, self.secrets.seal(value, key), _SEALED_KIND)

    def get(self, key: str, default: Any = None, con: Any = None) -> Any:
        """The value under ``key``; ``default`` when none is stored; :class:`SecretGoneError`
        when one is stored but its job's key is destroyed."""
        sealed = self.artifacts.get(key, _MISSING, con=con)
        if sealed is _MISSING:
            return default
        return self.secrets.open(sealed, key)

    def destroy(self) -> bool:
        return self.secrets.destroy()


class JobKeyPair:
    """A party's Paillier key pair for one job: ``n`` in its store in the clear, ``p`` and
    ``q`` sealed under the job's key file (written in one transaction), so shredding that
    file retires them whatever the database's pages still hold."""

    def __init__(self, store: PartyStore, scope: str) -> None:
        self.scope = scope  # e.g. "vertical/<job id>": the keys below it and the key file's
        self.sealed = SealedArtifacts(store, scope)
        self.artifacts = self.sealed.artifacts

    def key(self, part: str) -> str:
        return f"{self.scope}/{part}"

    def n(self) -> int | None:
        stored = self.artifacts.get(self.key("keypair"))
        return None if stored is None else int(stored["n"])

    def create(self, key_size: int, allow_insecure_key_size: bool) -> int:
        """The job's ``n``: the stored one, else a new key pair's, stored with its factors."""
        n = self.n()
        if n is None:
            public, private = generate_keypair(
                key_size, allow_insecure_key_size=allow_insecure_key_size
            )
            with self.artifacts.store.transaction() as con:
                self.artifacts.put(self.key("keypair"), {"n": public.n}, "public-key", con=con)
                self.sealed.put(self.key("factors"), {"p": private.p, "q": private.q}, con)
            n = public.n
        return n

    def private(self) -> PaillierPrivateKey | None:
        """The private key, or None: never created, or retired."""
        n = self.n()
        try:
            factors = self.sealed.get(self.key("factors"))
        except SecretGoneError:
            factors = None
        if n is None or factors is None:
            return None
        return PaillierPrivateKey(PaillierPublicKey(n), int(factors["p"]), int(factors["q"]))

    def retired(self) -> bool:
        """The key pair was created and its factors are destroyed."""
        return self.n() is not None and not self.sealed.secrets.exists()

    def retire(self, *parts: str) -> None:
        """Delete the sealed factors (and the records under ``parts``), then shred the key
        file; again (a re-run after a crash in between) is a no-op."""
        with self.artifacts.store.transaction() as con:
            for part in ("factors", *parts):
                self.artifacts.delete_prefix(self.key(part), con=con)
        self.sealed.destroy()
