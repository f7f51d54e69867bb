"""``bili run --transparent``: a program that ignores proxy variables, in bili's network namespace,
reaches the scripted model through bili and is folded; its traffic to a non-model host leaves
untouched (its own CA verifies the server, and the server sees the namespace's address).

Everything stays on this machine: the "model host" is an unassigned address whose TCP 443 the
namespace's redirect hands to mitmproxy's transparent listener (the test route addon then sends
the decrypted request to the fake upstream on 127.0.0.1); the non-model host is a TLS server on an
address added to ``lo`` for the test.  Needs root (namespaces, nftables); nftables is installed
with apt-get when missing, as the browser tests install chromium.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bili_addon import transparent

from .support import REPO, ROUTE_ADDON, clean_env, free_port, need_root_and_nft
from .test_fold_e2e import FOLDED, KEPT, TASK, Turns, assert_folded, marker_re, session_script

pytestmark = pytest.mark.e2e

CLIENT = Path(__file__).resolve().parent / "transparent_client.py"
TURNS = 10  # 1-7 read, 8 compresses turns 1-4, 9 reads on (the fold is on the wire), 10 answers


def _addresses() -> tuple[str, str]:
    """(model address, non-model address) of this test run: 10.232.x.2 / 10.232.x.3."""
    k = os.getpid() % 16000 + 1
    base = ipaddress.ip_address("10.232.0.0") + k * 4
    return str(base + 2), str(base + 3)


def _tls_pair(tmp: Path, ip: str) -> tuple[Path, Path, Path]:
    """A CA of the test's own and a server certificate for ``ip`` signed by it: (ca, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bili transparent test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ip)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = tmp / "other-ca.pem", tmp / "other-cert.pem", tmp / "other-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class OtherServer:
    """A TLS server that is not a model host, on ``ip:443`` (an address added to ``lo``): it answers
    every request with ``other-ok`` and records who connected."""

    def __init__(self, ip: str, cert: Path, key: Path):
        import socket

        self.ip = ip
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, 443))
        self.sock.listen()
        self.peers: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            try:
                with self.ctx.wrap_socket(conn, server_side=True) as tls:
                    self.peers.append(addr[0])
                    tls.recv(65536)
                    tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\nconnection: close\r\n\r\nother-ok")
            except (OSError, ssl.SSLError):
                continue

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    need_root_and_nft()
    model_ip, other_ip = _addresses()
    tmp = tmp_path_factory.mktemp("transparent-net")
    ca, cert, key = _tls_pair(tmp, other_ip)
    subprocess.run(["ip", "addr", "add", f"{other_ip}/32", "dev", "lo"], check=True, capture_output=True)
    server = OtherServer(other_ip, cert, key)
    yield {"model_ip": model_ip, "other_ip": other_ip, "other_ca": ca, "server": server}
    server.close()
    subprocess.run(["ip", "addr", "del", f"{other_ip}/32", "dev", "lo"], capture_output=True)


def _client_command(mechanism: str, tmp_path: Path, cfg: Path) -> list[str]:
    """The client's command line.  For local mode (which captures processes by name) it runs under a
    name of this test's own: a script's process is named after the script."""
    if mechanism != "local":
        return [sys.executable, str(CLIENT), str(cfg)]
    name = f"blc{os.getpid() % 100000}"
    wrapper = tmp_path / name
    wrapper.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv = [{str(CLIENT)!r}, {str(cfg)!r}]\n"
                       f"runpy.run_path({str(CLIENT)!r}, run_name='__main__')\n")
    wrapper.chmod(0o755)
    return [str(wrapper)]


@pytest.mark.parametrize("mechanism", transparent.MECHANISMS)
def test_a_client_that_ignores_proxies_is_folded_and_other_traffic_is_untouched(fake, network, sid, tmp_path,
                                                                                 mechanism):
    if mechanism == "local":
        local = {m.name: m for m in transparent.support()}["local"]
        if not local.ok:
            pytest.skip(f"--transparent=local does not work here: {local.why}")
    fake.script(sid, session_script()[: TURNS - 1] + [session_script()[-1]])
    port, tport = free_port(), free_port()
    forward_before = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    cfg = tmp_path / "client.json"
    cfg.write_text(json.dumps({
        "model_url": f"https://{network['model_ip']}/v1", "sid": sid, "task": TASK, "turns": TURNS,
        "other_url": f"https://{network['other_ip']}/", "other_ca": str(network["other_ca"]),
    }))
    run = tmp_path / "run"
    run.mkdir()
    env = clean_env(XDG_RUNTIME_DIR=str(run), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "bili_addon.cli", "run", f"--transparent={mechanism}", "--listen-port", str(port),
           "--transparent-port", str(tport), "--data-dir", str(tmp_path / "data"), "--confdir", str(tmp_path / "conf"),
           "--redirect", network["model_ip"],
           "--set", f"scripts={ROUTE_ADDON}", "--set", f"test_route=127.0.0.1:{fake.port}",
           "--set", "connection_strategy=lazy", "--set", "bili_activate=always",
           "--", *_client_command(mechanism, tmp_path, cfg)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    log = (run / "bili-addon" / f"proxy-{port}.log")
    proxy_log = log.read_text() if log.exists() else ""
    assert r.returncode == 0, f"stderr:\n{r.stderr[-3000:]}\nproxy log:\n{proxy_log[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])

    # the client was given a proxy and ignored it (trust_env=False): every request came by the redirect
    assert out["https_proxy"]
    up = Turns(fake, sid)
    for t in range(1, TURNS + 1):
        assert up[t].header("host") == network["model_ip"]
    # folded: turn 9 carries the fold of turns 1-4, the client saw the marker
    assert_folded(up[9].body, FOLDED, KEPT)
    assert marker_re("b1").match(out["answers"]["9"]), out["answers"]["9"]
    assert "[bili] compressed" not in up[10].body.decode()
    assert f"session={sid} " in proxy_log

    # the non-model host: its own certificate reached the client (nothing decrypted it)
    assert out["other"] == {"status": 200, "body": "other-ok"}
    assert f"https://{network['other_ip']}/" not in proxy_log, "no HTTP flow of the non-model host in the proxy"
    if mechanism == "local":
        assert "Local redirector started" in proxy_log
        assert f"local:{_client_command(mechanism, tmp_path, cfg)[0].rsplit('/', 1)[1]}" in r.stderr
        return

    m = re.search(r"runs in network namespace (bili-\d+) \((10\.231\.[\d.]+)\)", r.stderr)
    assert m, r.stderr
    netns, ns_ip = m.groups()
    assert out["https_proxy"].startswith("http://10.231."), out["https_proxy"]  # the proxy as seen from there
    # reached directly from the namespace's address: mitmproxy never saw the connection
    assert network["server"].peers[-1] == ns_ip
    assert network["other_ip"] not in proxy_log

    # nothing is left behind: the namespace, its table, ip_forward as it was
    assert netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    tables = subprocess.run([transparent.which("nft"), "list", "tables"], capture_output=True, text=True).stdout
    assert f"bili_{netns.split('-')[1]}" not in tables
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == forward_before
