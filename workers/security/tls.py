"""Optional mutual TLS for the gRPC control calls and the TCP KV transfer.

A folder in cert-manager's Secret layout: `tls.crt` (this worker's
certificate chain), `tls.key` (its key), `ca.crt` (the cluster's CA). Both
ends present a certificate signed by that CA, and each checks that the
other's names `TLS_SERVER_NAME` (a DNS name in its subject alternative
names): pods are reached by IP address, which a certificate rarely holds, so
all workers of a cluster share one name instead. TLS adds privacy and a
second, certificate-based proof of membership; the cluster key still
authenticates every call and handshake.

The files are read again for each new transfer connection (so a renewed
certificate is used from the next link on); the gRPC server reads them at
start (a renewal takes a pod restart there).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc loads only where a channel or server is made: `disagg serve --help` stays light
    import grpc

TLS_SERVER_NAME = "disagg-worker"  # the DNS name every worker certificate of a cluster carries
CERT_FILE, KEY_FILE, CA_FILE = "tls.crt", "tls.key", "ca.crt"
# gRPC checks the server's name against the target's host: here an IP, so it is told the shared name.
GRPC_CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", TLS_SERVER_NAME),)


@dataclass(frozen=True)
class TlsFiles:
    folder: Path

    @classmethod
    def from_folder(cls, folder: str | Path) -> TlsFiles:
        """The TLS files in `folder`; ValueError naming what is missing or unusable."""
        tls = cls(Path(folder))
        tls.server_context()  # loads and checks all three now, so a bad folder fails at start
        return tls

    def _read(self, name: str) -> bytes:
        try:
            return (self.folder / name).read_bytes()
        except OSError as exc:
            raise ValueError(f"TLS file {str(self.folder / name)!r}: {exc.strerror or exc}") from exc

    def _context(self, purpose: int) -> ssl.SSLContext:
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.folder / CERT_FILE, self.folder / KEY_FILE)
            context.load_verify_locations(cafile=self.folder / CA_FILE)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"TLS files in {str(self.folder)!r} ({CERT_FILE}, {KEY_FILE}, {CA_FILE}): {exc}") from exc
        context.verify_mode = ssl.CERT_REQUIRED  # both ends: mutual TLS
        return context

    def server_context(self) -> ssl.SSLContext:
        """For an accepted transfer connection: requires the peer's certificate from the CA."""
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        """For a transfer connection this side opens (wrap with server_hostname=TLS_SERVER_NAME)."""
        context = self._context(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = True
        return context

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials([(self._read(KEY_FILE), self._read(CERT_FILE))],
                                           root_certificates=self._read(CA_FILE), require_client_auth=True)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self._read(CERT_FILE), self._read(KEY_FILE), self._read(CA_FILE))


def channel_credentials(cert: bytes, key: bytes, ca: bytes) -> grpc.ChannelCredentials:
    """A gRPC client's side of mutual TLS (the operator builds it from the Secret's items)."""
    import grpc

    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
