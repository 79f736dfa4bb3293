"""The cluster key and what is derived from it.

Every worker of a cluster (and the operator, and `disagg link`) holds the same
random key. Nothing ever sends the key itself: a gRPC or HTTP control call
carries a credential

    v1.<unix ms>.<nonce: 32 hex>.<HMAC-SHA256(key, "call" | method | ms | nonce): 64 hex>

checked for its method, a clock skew of at most `max_skew_s` and a nonce not
seen within that window by the worker checking it (so a captured credential
cannot be replayed on that worker; it is bound to neither the worker nor the
call's body, which TLS keeps from anyone on the path: docs/security.md), and
the transfer handshake proves the key with `ClusterKey.proof` over both ends'
nonces and names.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

KEY_FILE_ENV = "DISAGG_CLUSTER_KEY_FILE"  # the default of every --cluster-key-file
KEY_ENV = "DISAGG_CLUSTER_KEY"  # the key itself, when no file is named (a file is preferred: it can rotate)
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096
DEFAULT_MAX_SKEW_S = 30.0
MAX_REPLAY_ENTRIES = 1 << 18  # nonces remembered at once: 30 s of 8,700 calls a second
_VERSION = "v1"
RELOAD_CHECK_S = 1.0  # how often a key file is looked at for a change

log = logging.getLogger(__name__)


class AuthError(Exception):
    """A credential or proof that does not check out; `str()` is for the log, never for the peer."""


def default_key_file() -> str | None:
    """The key file named by DISAGG_CLUSTER_KEY_FILE, if set (the one place it is read)."""
    return os.environ.get(KEY_FILE_ENV) or None


def key_from_environment() -> ClusterKey | None:
    """The key in DISAGG_CLUSTER_KEY, if set (the one place it is read); ValueError if it is not a key."""
    text = os.environ.get(KEY_ENV)
    if not text:
        return None
    try:
        return ClusterKey(text.encode())
    except ValueError as exc:
        raise ValueError(f"${KEY_ENV}: {exc}") from exc


class ClusterKey:
    """A cluster's shared secret: the key calls are signed with, and the keys still accepted.

    The key text is one key per line: the first signs; every line is accepted
    when checking. One line is the usual case. A rotation (docs/security.md)
    goes through "old, new" (accept the new key before anyone signs with it),
    then "new, old" (sign with it while old signers remain), then "new", so
    two workers at neighbouring steps always understand each other.

    A key read from a file follows the file: when it changes (a mounted Secret
    that the kubelet updates), the next use reads it again. Its repr never
    shows a key.
    """

    def __init__(self, text: bytes, path: Path | None = None) -> None:
        self._secrets = self._parse(text)
        self._path = path
        self._stamp = self._file_stamp() if path is not None else None
        self._refused_stamp: tuple[int, int, int] | None = None  # the unusable file last warned of
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    @staticmethod
    def _parse(text: bytes) -> tuple[bytes, ...]:
        secrets_ = tuple(line.strip() for line in text.strip().splitlines() if line.strip())
        if not secrets_:
            raise ValueError("a cluster key must not be empty")
        for secret in secrets_:
            if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
                raise ValueError(f"a cluster key must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, got {len(secret)}")
        return secrets_

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterKey:
        """The key in `path` (surrounding whitespace ignored, as a mounted Secret may end in a newline)."""
        return cls(cls._read(Path(path)), Path(path))

    @staticmethod
    def _read(path: Path) -> bytes:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the cluster key file {str(path)!r}: {exc.strerror or exc}") from exc
        try:
            ClusterKey._parse(text)
        except ValueError as exc:
            raise ValueError(f"cluster key file {str(path)!r}: {exc}") from exc
        return text

    @classmethod
    def generate(cls) -> ClusterKey:
        """A fresh random key, as 64 hex characters (printable, so it can live in a file or a Secret)."""
        return cls(new_key_text())

    def write(self, path: Path) -> None:
        """Store the key in a new file only its owner can read."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\n".join(self._secrets))

    def __repr__(self) -> str:
        return f"ClusterKey(<{len(self._secrets)} hidden>)"

    def replace(self, text: bytes) -> None:
        """Take new key text (the operator, when the cluster's Secret changes); ValueError if it is not a key."""
        secrets_ = self._parse(text)
        with self._lock:
            self._secrets = secrets_

    def _file_stamp(self) -> tuple[int, int, int] | None:
        assert self._path is not None
        try:
            st = self._path.stat()  # follows the kubelet's ..data link to the current files
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _current(self) -> tuple[bytes, ...]:
        """The keys now, after re-reading the file when it changed (looked at most once a second)."""
        if self._path is not None and time.monotonic() - self._checked >= RELOAD_CHECK_S:
            with self._lock:
                self._checked = time.monotonic()
                stamp = self._file_stamp()
                if stamp is not None and stamp not in (self._stamp, self._refused_stamp):
                    try:
                        self._secrets = self._parse(self._read(self._path))
                        self._stamp = stamp
                        log.info("cluster key file %s changed: %d key(s) now accepted", self._path,
                                 len(self._secrets))
                    except ValueError as exc:  # half-written or wrong: keep the keys that work
                        self._refused_stamp = stamp  # read again, and told again, once it changes
                        log.warning("cluster key file changed but is unusable, keeping the previous keys: %s", exc)
        return self._secrets

    def fingerprint(self) -> str:
        """Names the keys (in order) without revealing them: for /health, so the operator
        can tell when every worker has taken a rotation step."""
        return ",".join(_mac(s, "fingerprint")[:12] for s in self._current())

    def mac(self, *parts: str) -> str:
        """HMAC-SHA256 over the parts with the signing key."""
        return _mac(self._current()[0], *parts)

    def matches(self, mac: str, *parts: str) -> bool:
        """Whether `mac` is the HMAC over the parts by any accepted key."""
        if not mac.isascii():  # a MAC is hex; anything else (a lone surrogate) cannot even be encoded
            return False
        return any(hmac.compare_digest(mac.encode(), _mac(s, *parts).encode()) for s in self._current())

    def credential(self, method: str, now: float | None = None) -> str:
        """A one-time credential for one call of `method` (e.g. "/xllm.proto.DisaggPDService/LinkInstance")."""
        ms = str(int((time.time() if now is None else now) * 1000))
        nonce = secrets.token_hex(16)
        return f"{_VERSION}.{ms}.{nonce}.{self.mac('call', method, ms, nonce)}"

    def proof(self, side: str, *bound: str) -> str:
        """The handshake's proof of the key by `side` ("initiator" or "acceptor"), bound to `bound`."""
        return self.mac("handshake", side, *bound)

    def check_proof(self, proof: str, side: str, *bound: str) -> None:
        if not self.matches(proof, "handshake", side, *bound):
            raise AuthError(f"the {side}'s handshake proof is wrong")


def new_key_text() -> bytes:
    """A fresh random key (64 hex characters): what `generate` and the operator's Secret hold."""
    return secrets.token_hex(32).encode()


def _mac(secret: bytes, *parts: str) -> str:
    """HMAC-SHA256 over the parts, each length-prefixed so that no two part lists collide."""
    raw = [p.encode("utf-8", "surrogatepass") for p in parts]  # total: a peer's name may hold anything
    message = b"".join(len(r).to_bytes(4, "big") + r for r in raw)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class CredentialVerifier:
    """Checks control-call credentials: the right key, method and time, and each one used once.

    Thread-safe (the HTTP routes and the gRPC server share one).
    """

    def __init__(self, key: ClusterKey, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 clock: Callable[[], float] = time.time) -> None:
        if max_skew_s <= 0:
            raise ValueError(f"max_skew_s must be positive, got {max_skew_s}")
        self._key = key
        self._max_skew_s = max_skew_s
        self._clock = clock
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def verify(self, method: str, credential: str) -> None:
        """Raise AuthError unless `credential` was made with the key for `method`, recently, and not used before."""
        parts = credential.split(".")
        if len(parts) != 4 or parts[0] != _VERSION or not parts[1].isdigit() or len(parts[2]) != 32:
            raise AuthError("malformed credential")
        _, ms, nonce, mac = parts
        if not self._key.matches(mac, "call", method, ms, nonce):
            raise AuthError(f"credential for another key or method than {method}")
        now = self._clock()
        skew = abs(now - int(ms) / 1000)
        if skew > self._max_skew_s:
            raise AuthError(f"credential {skew:.0f} s off this clock (at most {self._max_skew_s:.0f} s allowed)")
        with self._lock:
            if nonce in self._seen:
                raise AuthError("credential replayed")
            if len(self._seen) >= MAX_REPLAY_ENTRIES:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                if len(self._seen) >= MAX_REPLAY_ENTRIES:
                    raise AuthError("too many credentials within the replay window")
            # A nonce must be remembered for as long as its timestamp is acceptable.
            self._seen[nonce] = int(ms) / 1000 + self._max_skew_s
