"""Tokens on gRPC streams and TLS on both transports, against a real service."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rematd import wire
from rematd.server import ServeConfig, ServiceThread
from rematd.server.app import ExposedWithoutToken
from rematd.server.cli import main as cli_main
from rematd.server.core.errors import Unauthenticated
from rematd.server.credentials import load_token
from rematd.server.transport.auth import TokenAuth
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import hello

TOKEN = "stream-token-0123456789abcdef"


def self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rematd-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def open_stream(channel: grpc.Channel, metadata: list[tuple[str, str]] | None) -> grpc.RpcError | pb.ServerMessage:
    msgs = iter([pb.ClientMessage(hello=wire.hello_to_pb(hello(job="secure")))])
    call = pb_grpc.AdvisorStub(channel).Session(msgs, timeout=10, metadata=metadata)
    try:
        return next(iter(call))
    except grpc.RpcError as err:
        return err


def test_streams_need_the_token_when_one_is_set(tmp_path: Path) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), token=TOKEN))
    bound = svc.start()
    try:
        with grpc.insecure_channel(bound.grpc) as ch:
            for md in (None, [("authorization", "Bearer not-the-right-token")], [("authorization", TOKEN)]):
                got = open_stream(ch, md)
                assert isinstance(got, grpc.RpcError) and got.code() == grpc.StatusCode.UNAUTHENTICATED, md
            got = open_stream(ch, [("authorization", f"Bearer {TOKEN}")])
            assert isinstance(got, pb.ServerMessage) and got.plan.version == 1
        with httpx.Client(base_url=f"http://{bound.http}") as http:
            assert http.post("/api/v1/jobs/secure/pin", json={"checkpoint_every": 1}).status_code == 401
            r = http.post(
                "/api/v1/jobs/secure/pin", json={"checkpoint_every": 1}, headers={"authorization": f"Bearer {TOKEN}"}
            )
            assert r.status_code == 200
            assert "rematd_unauthenticated_requests_total" in http.get("/metrics").text
    finally:
        svc.stop()


def test_tls_on_grpc_and_http(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    cfg = ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), tls_cert=str(cert), tls_key=str(key))
    svc = ServiceThread(cfg)
    bound = svc.start()
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(bound.grpc, creds) as ch:
            got = open_stream(ch, None)
            assert isinstance(got, pb.ServerMessage) and got.plan.version == 1
        with grpc.insecure_channel(bound.grpc) as plain:
            got = open_stream(plain, None)
            assert isinstance(got, grpc.RpcError) and got.code() == grpc.StatusCode.UNAVAILABLE
        assert bound.dashboard.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(cert))
        r = httpx.get(f"https://{bound.http}/api/v1/jobs/secure", verify=ctx, timeout=10)
        assert r.status_code == 200 and r.json()["job"] == "secure"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"https://{bound.http}/healthz", timeout=10)  # not trusted without the CA
    finally:
        svc.stop()


def test_settings_are_checked_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="tls-cert and tls-key"):
        ServeConfig(tls_cert=str(tmp_path / "x.pem"))
    with pytest.raises(ValueError, match="token"):
        ServeConfig(token="short")
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ValueError, match="token-file"):
        load_token(str(empty))
    (tmp_path / "tok").write_text(f"{TOKEN}\n")
    assert load_token(str(tmp_path / "tok")) == TOKEN
    monkeypatch.setenv("REMATD_TOKEN", TOKEN)
    assert load_token(None) == TOKEN


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--http-host", "0.0.0.0"], "--http-host 0.0.0.0"),
        (["--grpc-host", "0.0.0.0"], "--grpc-host 0.0.0.0"),
        (["--http-host", "10.1.2.3", "--public-reads"], "--http-host 10.1.2.3"),
    ],
)
def test_serve_refuses_to_listen_beyond_loopback_without_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    monkeypatch.delenv("REMATD_TOKEN", raising=False)
    db = tmp_path / "r.db"
    code = cli_main(["serve", "--grpc-port", "0", "--http-port", "0", "--db", str(db), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err and "token" in err and "REMATD_TOKEN" in err
    assert not db.exists(), "refused before anything was opened"


def test_writes_without_a_token_are_open_only_while_http_binds_loopback() -> None:
    assert TokenAuth.serving(ServeConfig()).open_writes
    assert TokenAuth.serving(ServeConfig(http_host="localhost")).open_writes
    # A gRPC-only worker names no HTTP address it listens on.
    worker = TokenAuth.serving(ServeConfig(http_host="0.0.0.0", http=False, public_reads=True))
    assert not worker.open_writes and worker.open_reads
    exposed = TokenAuth(open_writes=False)
    with pytest.raises(Unauthenticated, match="writes need a token"):
        exposed.check_write(None)
    guarded = TokenAuth.serving(ServeConfig(http_host="0.0.0.0", token=TOKEN))
    guarded.check_write(f"Bearer {TOKEN}")
    with pytest.raises(Unauthenticated):
        guarded.check_write(None)


@pytest.mark.parametrize(
    ("hosts", "named"),
    [
        ({"grpc_host": "0.0.0.0"}, "--grpc-host 0.0.0.0"),
        ({"http_host": "10.1.2.3"}, "--http-host 10.1.2.3"),
        ({"grpc_host": "::", "http_host": "::"}, "--grpc-host ::"),
    ],
)
def test_every_entry_point_refuses_to_listen_beyond_loopback_without_a_token(
    tmp_path: Path, hosts: dict[str, str], named: str
) -> None:
    db = tmp_path / "r.db"
    with pytest.raises(ExposedWithoutToken, match=f"{named} is not a loopback address.*REMATD_TOKEN"):
        ServeConfig(grpc_port=0, http_port=0, db=str(db), **hosts)  # type: ignore[arg-type]
    # The service built directly (as the demo and tests build it) gets no further.
    with pytest.raises(ExposedWithoutToken):
        ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db), **hosts))  # type: ignore[arg-type]
    assert not db.exists()
    # A token lets it listen there.
    ServeConfig(grpc_port=0, http_port=0, db=str(db), token=TOKEN, **hosts)  # type: ignore[arg-type]


def test_a_certificate_or_key_that_does_not_load_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = self_signed(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = self_signed(other)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    db = str(tmp_path / "r.db")
    cases = (
        (garbage, key, "--tls-cert", "holds no PEM certificate"),
        (cert, garbage, "--tls-key", "holds no PEM private key"),
        (cert, other_key, "--tls-key", "is not the private key of --tls-cert"),
    )
    for bad_cert, bad_key, flag, said in cases:
        with pytest.raises(ValueError, match=said) as err:
            ServeConfig(grpc_port=0, http_port=0, db=db, tls_cert=str(bad_cert), tls_key=str(bad_key))
        assert str(err.value).startswith(flag), err.value
        # The command line exits 2 naming the flag, before a port is bound.
        with pytest.raises(SystemExit) as exit:
            cli_main(["serve", "--db", db, "--tls-cert", str(bad_cert), "--tls-key", str(bad_key)])
        assert exit.value.code == 2 and "tls-" in capsys.readouterr().err
    ServeConfig(grpc_port=0, http_port=0, db=db, tls_cert=str(cert), tls_key=str(key))  # the pair that loads
