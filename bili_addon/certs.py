"""The proxy's certificate authority: where it lives, creating it, and the CA bundles agents need.

mitmproxy signs a certificate for every HTTPS host on the fly with its own CA, so an agent talking
through the proxy in forward mode has to trust that CA.  Node/Bun agents add it with
``NODE_EXTRA_CA_CERTS=<confdir>/mitmproxy-ca-cert.pem``; agents that take one bundle *instead of*
the system roots (codex, Python's requests/httpx via ``SSL_CERT_FILE``/``REQUESTS_CA_BUNDLE``) get
``<confdir>/combined-ca.pem``: the system roots plus our CA.

The confdir defaults to the checkout's ``certs/`` folder (git-ignored), else
``$XDG_DATA_HOME/bili-addon/certs``.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import bili_addon
from bili_addon.store import default_data_dir

BASENAME = "mitmproxy"  # mitmproxy's own file names, so `--set confdir=` finds the same CA
KEY_SIZE = 2048
CA_CERT = f"{BASENAME}-ca-cert.pem"  # certificate only: what clients trust
CA_KEY = f"{BASENAME}-ca.pem"  # private key + certificate: what the proxy signs with
COMBINED = "combined-ca.pem"

# where the system's trusted roots usually are, after $SSL_CERT_FILE
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine, Arch
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/cert.pem",  # macOS, BSDs
)

_PEM_CERT = b"-----BEGIN CERTIFICATE-----"


class CertError(RuntimeError):
    """The CA cannot be created or read."""


@dataclass(frozen=True, slots=True)
class CAPaths:
    confdir: Path
    cert: Path  # mitmproxy-ca-cert.pem
    key: Path  # mitmproxy-ca.pem
    combined: Path  # combined-ca.pem
    roots_source: str | None  # where the system roots in the combined bundle came from
    secured: tuple[Path, ...]  # files holding a private key, all mode 0600


def checkout_root() -> Path | None:
    """The source checkout this package runs from, or None when installed elsewhere."""
    root = Path(bili_addon.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


def _writable_dir(path: Path) -> bool:
    if path.is_dir():
        return os.access(path, os.W_OK | os.X_OK)
    if path.exists():
        return False
    return path.parent.is_dir() and os.access(path.parent, os.W_OK | os.X_OK)


def fallback_confdir() -> Path:
    return default_data_dir() / "certs"


def default_confdir(checkout: Path | None = None) -> Path:
    """``<checkout>/certs`` when running from a writable checkout, else ``$XDG_DATA_HOME/bili-addon/certs``."""
    root = checkout if checkout is not None else checkout_root()
    if root is not None and _writable_dir(root / "certs"):
        return root / "certs"
    return fallback_confdir()


def ensure_ca(confdir: str | os.PathLike[str] | None = None) -> CAPaths:
    """Create the CA in ``confdir`` if missing (mitmproxy's own generator and file layout),
    restrict its private files to 0600, and rewrite the combined bundle."""
    d = Path(confdir).expanduser().resolve() if confdir else default_confdir()
    try:
        if not d.exists():
            d.mkdir(parents=True, mode=0o700)
    except OSError as e:
        raise CertError(f"cannot create the CA directory {d}: {e}") from e
    from mitmproxy.certs import CertStore  # imported late: mitmproxy is heavy and only needed here

    try:
        CertStore.from_store(d, BASENAME, key_size=KEY_SIZE)
    except Exception as e:  # OSError, or a CA file that does not parse
        raise CertError(f"cannot create or load the mitmproxy CA in {d}: {e}") from e
    secured = secure_private_files(d)
    cert = d / CA_CERT
    if not cert.is_file():
        raise CertError(f"{cert} is missing although {d / CA_KEY} exists; delete {d / CA_KEY} to regenerate the CA")
    try:
        source = write_combined(d, cert.read_bytes())
    except OSError as e:
        raise CertError(f"cannot write {d / COMBINED}: {e}") from e
    return CAPaths(d, cert, d / CA_KEY, d / COMBINED, source, tuple(secured))


def _holds_private_key(path: Path) -> bool:
    name = path.name
    if name == CA_KEY or name == f"{BASENAME}-ca.p12":
        return True
    suffix = path.suffix.lower()
    try:
        if suffix == ".pem":
            return b"PRIVATE KEY" in path.read_bytes()
        if suffix in (".p12", ".pfx"):
            from cryptography.hazmat.primitives.serialization import pkcs12

            try:
                key, _, _ = pkcs12.load_key_and_certificates(path.read_bytes(), None)
            except (ValueError, TypeError):
                return True  # encrypted or unreadable: treat as secret
            return key is not None
    except OSError:
        return False
    return False


def secure_private_files(confdir: Path) -> list[Path]:
    """chmod 0600 every file in ``confdir`` that holds a private key; returns them."""
    out = []
    for p in sorted(confdir.iterdir()):
        if not p.is_file() or p.is_symlink() or not _holds_private_key(p):
            continue
        try:
            if stat.S_IMODE(p.stat().st_mode) != 0o600:
                p.chmod(0o600)
        except OSError as e:
            raise CertError(f"cannot restrict {p} to mode 0600: {e}") from e
        out.append(p)
    return out


def system_roots(exclude: Path | None = None) -> tuple[str | None, bytes]:
    """The first readable bundle of trusted roots: ``$SSL_CERT_FILE``, the usual system files,
    then certifi.  ``exclude`` (our own combined bundle) is skipped so it never feeds itself."""
    candidates: list[str] = []
    if os.environ.get("SSL_CERT_FILE"):
        candidates.append(os.environ["SSL_CERT_FILE"])
    candidates.extend(SYSTEM_BUNDLES)
    try:
        import certifi

        candidates.append(certifi.where())
    except ImportError:
        pass
    skip = exclude.resolve() if exclude is not None else None
    for c in candidates:
        p = Path(c)
        try:
            if skip is not None and p.resolve() == skip:
                continue
            data = p.read_bytes()
        except OSError:
            continue
        if _PEM_CERT in data:
            return str(p), data
    return None, b""


def write_combined(confdir: Path, ca_pem: bytes, name: str = COMBINED) -> str | None:
    """Write ``<confdir>/combined-ca.pem`` (``name``) = system roots + our CA, atomically; returns the
    roots' source."""
    target = confdir / name
    source, roots = system_roots(exclude=target)
    ca_pem = ca_pem.strip() + b"\n"
    roots = roots.replace(ca_pem, b"")  # a copy of an earlier combined bundle: do not repeat our CA
    body = roots if not roots or roots.endswith(b"\n") else roots + b"\n"
    body += b"# bili-addon: the mitmproxy CA\n" + ca_pem
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=confdir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return source


# -- the CA of a proxy this install did not start ------------------------------------------------------
def sha256(cert_pem: bytes) -> str:
    """The SHA-256 fingerprint (hex) of the first certificate in ``cert_pem``; ValueError if none."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    return x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256()).hex()


def cert_with(path: str | os.PathLike[str], fingerprint: str) -> bytes | None:
    """The PEM of the certificate in the file ``path`` whose SHA-256 is ``fingerprint``, or None (the
    file cannot be read, holds no such certificate).  Only that certificate: whatever else the file
    holds (a private key, other certificates) is never trusted with it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    try:
        found = x509.load_pem_x509_certificates(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    want = fingerprint.lower().replace(":", "")
    for c in found:
        if c.fingerprint(hashes.SHA256()).hex() == want:
            return c.public_bytes(serialization.Encoding.PEM)
    return None


PROXY_CA = "proxy-ca-"  # <confdir>/proxy-ca-<sha256 prefix>.pem: another proxy's CA, a copy
PROXY_COMBINED = "proxy-combined-"  # system roots + that CA


def proxy_ca(ours: CAPaths, cert_pem: bytes) -> CAPaths:
    """The bundles an agent needs to trust another proxy's CA (``cert_pem``, its certificate only), made
    in this install's confdir as they are for our own CA: a copy of it, and the system roots plus it.
    ``key`` and ``secured`` stay ours (the agent is given certificates only)."""
    name = sha256(cert_pem)[:16]
    cert = ours.confdir / f"{PROXY_CA}{name}.pem"
    pem = cert_pem.strip() + b"\n"
    try:
        if not cert.is_file() or cert.read_bytes() != pem:
            fd, tmp = tempfile.mkstemp(prefix=f".{cert.name}.", suffix=".tmp", dir=ours.confdir)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(pem)
                os.chmod(tmp, 0o644)
                os.replace(tmp, cert)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        source = write_combined(ours.confdir, pem, f"{PROXY_COMBINED}{name}.pem")
    except OSError as e:
        raise CertError(f"cannot write the proxy's CA into {ours.confdir}: {e}") from e
    return CAPaths(ours.confdir, cert, ours.key, ours.confdir / f"{PROXY_COMBINED}{name}.pem", source, ours.secured)
