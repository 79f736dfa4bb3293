"""The cluster key and what is derived from it.

Every worker of a cluster (and the operator, and `disagg link`) holds the same
random key. Nothing ever sends the key itself: a gRPC or HTTP control call
carries a credential

    v1.<unix ms>.<nonce: 32 hex>.<HMAC-SHA256(key, "call" | method | ms | nonce): 64 hex>

checked for its method, a clock skew of at most `max_skew_s` and a nonce not
seen within that window (so a captured credential cannot be replayed), and the
transfer handshake proves the key with `ClusterKey.proof` over both ends'
nonces and names.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

KEY_FILE_ENV = "DISAGG_CLUSTER_KEY_FILE"  # the default of every --cluster-key-file
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096
DEFAULT_MAX_SKEW_S = 30.0
MAX_REPLAY_ENTRIES = 1 << 18  # nonces remembered at once: 30 s of 8,700 calls a second
_VERSION = "v1"


class AuthError(Exception):
    """A credential or proof that does not check out; `str()` is for the log, never for the peer."""


def default_key_file() -> str | None:
    """The key file named by DISAGG_CLUSTER_KEY_FILE, if set (the one place it is read)."""
    return os.environ.get(KEY_FILE_ENV) or None


class ClusterKey:
    """A cluster's shared secret. Its repr never shows the key."""

    def __init__(self, secret: bytes) -> None:
        if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
            raise ValueError(f"a cluster key must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, got {len(secret)}")
        self._secret = secret

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterKey:
        """The key in `path` (surrounding whitespace ignored, as a mounted Secret may end in a newline)."""
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the cluster key file {str(path)!r}: {exc.strerror or exc}") from exc
        try:
            return cls(secret)
        except ValueError as exc:
            raise ValueError(f"cluster key file {str(path)!r}: {exc}") from exc

    @classmethod
    def generate(cls) -> ClusterKey:
        """A fresh random key, as 64 hex characters (printable, so it can live in a file or a Secret)."""
        return cls(secrets.token_hex(32).encode())

    def write(self, path: Path) -> None:
        """Store the key in a new file only its owner can read."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self._secret)

    def __repr__(self) -> str:
        return "ClusterKey(<hidden>)"

    def mac(self, *parts: str) -> str:
        """HMAC-SHA256 over the parts, each length-prefixed so that no two part lists collide."""
        message = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def credential(self, method: str, now: float | None = None) -> str:
        """A one-time credential for one call of `method` (e.g. "/xllm.proto.DisaggPDService/LinkInstance")."""
        ms = str(int((time.time() if now is None else now) * 1000))
        nonce = secrets.token_hex(16)
        return f"{_VERSION}.{ms}.{nonce}.{self.mac('call', method, ms, nonce)}"

    def proof(self, side: str, *bound: str) -> str:
        """The handshake's proof of the key by `side` ("initiator" or "acceptor"), bound to `bound`."""
        return self.mac("handshake", side, *bound)

    def check_proof(self, proof: str, side: str, *bound: str) -> None:
        if not hmac.compare_digest(proof.encode(), self.proof(side, *bound).encode()):
            raise AuthError(f"the {side}'s handshake proof is wrong")


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
        if not hmac.compare_digest(mac.encode(), self._key.mac("call", method, ms, nonce).encode()):
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
