"""Security defaults: a 0600 Unix socket, 0600 shared memory with unpredictable names that is
unlinked on exit and on SIGTERM, TCP only on request and then with a token (or --insecure),
TLS and mutual TLS for TCP, and no pickle anywhere on the wire or on disk."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import eventually
from sidecar_util import filled_device, mimo_geometries, shm_exists

from hicache.client import ClientTls, HiCacheClient, HiCacheRpcError
from hicache.memory import create_shm
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server, parse_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_socket_is_0600_in_a_private_folder(sockdir):
    sock = os.path.join(sockdir, "run", "hc.sock")
    old = os.umask(0)  # even a permissive umask does not open it up
    try:
        srv, _ = create_server(ServerConfig(socket=sock))
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
    finally:
        srv.stop(0)
    assert not os.path.exists(sock)


def test_shared_memory_is_0600_unpredictable_and_unlinked_on_close():
    a, b = create_shm(4096), create_shm(4096)
    names = [a.handle.name, b.handle.name]
    for name in names:
        assert re.fullmatch(rf"hicache-\d+-{os.getpid()}-\d+-[0-9a-f]{{24}}", name)  # owner + 96 random bits
        assert stat.S_IMODE(os.stat(os.path.join("/dev/shm", name)).st_mode) == 0o600
    assert names[0] != names[1]
    a.close()
    b.close()
    assert not any(shm_exists(n) for n in names)


ENGINE = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, "tests")
    from sidecar_util import filled_device
    pools = [filled_device(2), filled_device(2)]
    print(" ".join(p.handle.name for p in pools), flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)  # no close(): the finalizers unlink at exit
    time.sleep(120)
    """
)


@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_engine_segments_are_unlinked_on_exit_and_on_sigterm(how):
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, how], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    names = proc.stdout.readline().split()
    assert len(names) == 2, proc.stderr.read() if proc.stderr else ""
    if how == "sigterm":
        assert all(shm_exists(n) for n in names)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM  # still reported as killed by SIGTERM
    else:
        assert proc.wait(60) == 0
    assert not any(shm_exists(n) for n in names)


# ---- TCP: token, TLS, mutual TLS --------------------------------------------------------------
def _pki(tmp: Path) -> dict[str, str]:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed
    by the CA; plus a second, unrelated CA. Written as PEM files; returns their paths."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    out: dict[str, str] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(label: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (tmp / f"{label}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp / f"{label}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        out[label] = str(tmp / f"{label}.crt")
        out[label + "_key"] = str(tmp / f"{label}.key")

    def issue(cn: str, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey | None, ca: bool, san: list):  # type: ignore[no-untyped-def,type-arg]
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(issuer if signer else name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer or key, hashes.SHA256()), key

    import ipaddress

    ca, ca_key = issue("hicache test CA", name("hicache test CA"), None, True, [])
    write("ca", ca, ca_key)
    other, other_key = issue("someone else's CA", name("someone else's CA"), None, True, [])
    write("other_ca", other, other_key)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server, server_key = issue("localhost", ca.subject, ca_key, False, san)
    write("server", server, server_key)
    client, client_key = issue("engine-1", ca.subject, ca_key, False, [x509.DNSName("engine-1")])
    write("client", client, client_key)
    return out


def _tcp_server(sockdir: str, **kwargs: object):  # type: ignore[no-untyped-def]
    config = ServerConfig(
        socket=os.path.join(sockdir, "hc.sock"),
        listen="127.0.0.1:0",
        service=ServiceConfig(expected=mimo_geometries()),
        **kwargs,  # type: ignore[arg-type]
    )
    srv, _ = create_server(config)
    return srv, srv.addresses[1]


def _refused(client: HiCacheClient) -> str:
    with pytest.raises(HiCacheRpcError) as exc:
        client.stats(all_pools=True)
    client.close()
    return exc.value.code.name


def test_tls_with_token(sockdir, tmp_path):
    pki = _pki(tmp_path)
    srv, tcp = _tcp_server(sockdir, token="s3cret", tls_cert=pki["server"], tls_key=pki["server_key"])
    dev = filled_device(2)
    try:
        port = tcp.rpartition(":")[2]
        with HiCacheClient(f"localhost:{port}", token="s3cret", timeout=10, tls=ClientTls(pki["ca"])) as client:
            client.register(dev)
            assert client.stats()[0].device_pages == 2
        assert _refused(HiCacheClient(tcp, token="s3cret", timeout=30, retries=0)) == "UNAVAILABLE"  # plaintext
        wrong_ca = ClientTls(pki["other_ca"], server_name="localhost")
        assert _refused(HiCacheClient(tcp, token="s3cret", timeout=30, retries=0, tls=wrong_ca)) == "UNAVAILABLE"
        no_token = ClientTls(pki["ca"], server_name="localhost")
        assert _refused(HiCacheClient(tcp, timeout=30, retries=0, tls=no_token)) == "UNAUTHENTICATED"
    finally:
        srv.stop(0)
        dev.close()


def test_mutual_tls_authenticates_the_client(sockdir, tmp_path):
    pki = _pki(tmp_path)
    srv, tcp = _tcp_server(
        sockdir, tls_cert=pki["server"], tls_key=pki["server_key"], tls_client_ca=pki["ca"], admin_token="adm"
    )
    try:
        mine = ClientTls(pki["ca"], cert=pki["client"], key=pki["client_key"], server_name="localhost")
        with HiCacheClient(tcp, timeout=10, tls=mine, admin_token="adm") as client:  # the certificate is the credential
            assert client.stats(all_pools=True) == []
        anonymous = ClientTls(pki["ca"], server_name="localhost")
        assert _refused(HiCacheClient(tcp, timeout=30, retries=0, tls=anonymous)) == "UNAVAILABLE"
        forged = ClientTls(pki["ca"], cert=pki["other_ca"], key=pki["other_ca_key"], server_name="localhost")
        assert _refused(HiCacheClient(tcp, timeout=30, retries=0, tls=forged)) == "UNAVAILABLE"
    finally:
        srv.stop(0)


def test_tcp_and_tls_flags_are_checked(sockdir, tmp_path):
    pki = _pki(tmp_path)
    sock = ["--socket", os.path.join(sockdir, "x.sock")]
    cases = [
        (["--listen", "127.0.0.1:0"], "without --token"),
        (["--tls-cert", pki["server"], "--tls-key", pki["server_key"]], "need --listen"),
        (["--listen", "127.0.0.1:0", "--insecure", "--tls-cert", pki["server"]], "go together"),
        (["--listen", "127.0.0.1:0", "--insecure", "--tls-client-ca", pki["ca"]], "needs --tls-cert"),
        (["--listen", "127.0.0.1:0", "--token", "t", "--tls-cert", "/nope", "--tls-key", "/nope"], "not a readable"),
    ]
    for argv, needle in cases:
        with pytest.raises(ValueError, match=needle):
            parse_args(sock + argv)
    config, _ = parse_args(
        sock
        + ["--listen", "127.0.0.1:0", "--tls-cert", pki["server"]]
        + ["--tls-key", pki["server_key"], "--tls-client-ca", pki["ca"]]
    )
    assert config.token is None and config.tls_client_ca == pki["ca"]  # mTLS is authentication enough
    config, _ = parse_args(sock)
    assert config.listen is None  # TCP only on request
    with pytest.raises(ValueError, match="needs its key"):
        ClientTls(pki["ca"], cert=pki["client"])


# ---- no pickle --------------------------------------------------------------------------------
UNSAFE = re.compile(
    r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|shelve|marshal|joblib)\b"
    r"|\bpickle\.|\ballow_pickle\s*=\s*True"
    r"|\btorch\.save\(|\btorch\.load\((?![^)]*weights_only\s*=\s*True)",
    re.MULTILINE,
)


def test_no_pickle_in_the_package_or_the_server():
    """Everything on the wire is protobuf and everything on disk is the page format (a fixed
    header + raw bytes): nothing can make the sidecar or a client unpickle."""
    offenders = []
    for folder in ("hicache", "server"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in UNSAFE.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert offenders == []
    assert UNSAFE.search("import pickle\n") and UNSAFE.search("x = torch.load(f)") and UNSAFE.search("pickle.loads(b)")
    assert not UNSAFE.search("torch.load(f, weights_only=True)")


def test_the_hicache_command_reaches_a_tls_listen_with_its_tls_flags(sockdir, tmp_path, capsys):
    from hicache.cli import main

    pki = _pki(tmp_path)
    srv, tcp = _tcp_server(
        sockdir, tls_cert=pki["server"], tls_key=pki["server_key"], tls_client_ca=pki["ca"], admin_token="adm"
    )
    mine = ["--tls-ca", pki["ca"], "--tls-cert", pki["client"], "--tls-key", pki["client_key"]]
    mine += ["--tls-server-name", "localhost"]
    try:
        eventually(lambda: main(["health", "--target", tcp, *mine]) == 0, what="SERVING over TLS")
        assert capsys.readouterr().out.splitlines()[-1] == "SERVING"
        assert main(["health", "--target", tcp, "--timeout", "5"]) == 2  # plaintext: no connection
        assert capsys.readouterr().out.split() == ["UNAVAILABLE"]
        assert main(["stats", "--target", tcp, "--admin-token", "adm", "--json", *mine]) == 0
        assert json.loads(capsys.readouterr().out)["pools"] == []
        assert main(["events", tcp, "--admin-token", "adm", "--duration", "1", "--no-snapshot", *mine]) == 0
        assert main(["health", "--target", tcp, "--tls-cert", pki["client"]]) == 2
        assert "--tls-cert need --tls-ca" in capsys.readouterr().err
        assert main(["health", "--target", tcp, "--tls-ca", str(tmp_path / "missing.pem")]) == 2
        assert "is not a readable file" in capsys.readouterr().err
    finally:
        srv.stop(0)
