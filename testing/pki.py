"""Keys, certificates and tokens for a throw-away control plane.

One short-lived CA signs the API server's serving certificate; an RSA key
pair signs service-account tokens; random bearer tokens name the identities
of the static token file. A second CA, the front proxy's, signs the client
certificate the aggregation layer presents to extension API servers (a metrics
adapter), which trust the user it names in X-Remote-User only from that CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

# The service network's first address is the `kubernetes` Service's ClusterIP,
# which in-cluster clients verify against the serving certificate.
SERVICE_CIDR = "10.0.0.0/24"
_VALIDITY = datetime.timedelta(days=7)
# The name the API server's proxy client certificate carries (--requestheader-allowed-names).
FRONT_PROXY_CLIENT = "front-proxy-client"


@dataclass(frozen=True)
class Identity:
    """One line of the API server's static token file."""

    user: str
    token: str
    groups: tuple[str, ...] = ()

    def csv_line(self) -> str:
        groups = ",".join(self.groups)
        return f'{self.token},{self.user},{self.user},"{groups}"'


def new_identity(user: str, *groups: str) -> Identity:
    return Identity(user=user, token=secrets.token_urlsafe(24), groups=tuple(groups))


def write_token_file(path: Path, identities: list[Identity]) -> None:
    path.write_text("".join(i.csv_line() + "\n" for i in identities))
    path.chmod(0o600)


@dataclass(frozen=True)
class PkiFiles:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path  # RSA private key: signs service-account tokens
    sa_pub: Path  # its public half: verifies them
    front_proxy_ca: Path  # --requestheader-client-ca-file
    front_proxy_client_cert: Path  # --proxy-client-cert-file
    front_proxy_client_key: Path


def _write_key(path: Path, key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca(now: datetime.datetime, common_name: str = "disagg-test-ca") -> tuple[ec.EllipticCurvePrivateKey,
                                                                             x509.Certificate]:
    # EC keys for TLS: generating them is instant, unlike RSA.
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def _leaf(ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], common_name: str, hosts: list[str],
          usages: list[x509.ObjectIdentifier], now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey,
                                                                                 x509.Certificate]:
    """A key and a certificate signed by `ca` for `hosts` (IP addresses or DNS names)."""
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca[1].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca[0], hashes.SHA256())
    )
    return key, cert


def write_tls_folder(directory: Path, hosts: list[str]) -> Path:
    """A folder in cert-manager's Secret layout (tls.crt, tls.key, ca.crt) with a new CA and
    one certificate for `hosts`, good for both ends of mutual TLS."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = _ca(now)
    usages = [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
    key, cert = _leaf(ca, hosts[0], hosts, usages, now)
    (directory / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / "tls.key", key)
    return directory


def write_pki(directory: Path, hosts: list[str]) -> PkiFiles:
    """Create the CA, the serving certificate for `hosts`, the SA key pair and the front proxy's CA and
    client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, ca_cert = _ca(now)
    serving_key, serving_cert = _leaf((ca_key, ca_cert), "kube-apiserver", hosts,
                                      [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH], now)
    # Service-account tokens are RS256 by convention; 2048 bits is the minimum
    # the API server accepts.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    # A CA of its own: a certificate the main CA signs must not pass as the front proxy.
    front_ca = _ca(now, "disagg-test-front-proxy-ca")
    proxy_key, proxy_cert = _leaf(front_ca, FRONT_PROXY_CLIENT, [FRONT_PROXY_CLIENT],
                                  [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH], now)

    files = PkiFiles(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
        front_proxy_ca=directory / "front-proxy-ca.crt",
        front_proxy_client_cert=directory / "front-proxy-client.crt",
        front_proxy_client_key=directory / "front-proxy-client.key",
    )
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(files.ca_key, ca_key)
    files.serving_cert.write_bytes(serving_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(files.serving_key, serving_key)
    _write_key(files.sa_key, sa_key)
    files.front_proxy_ca.write_bytes(front_ca[1].public_bytes(serialization.Encoding.PEM))
    files.front_proxy_client_cert.write_bytes(proxy_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(files.front_proxy_client_key, proxy_key)
    files.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return files
