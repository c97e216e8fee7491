"""HTTPS and mutual TLS through the real service, with throwaway certificates made here
(``cryptography``): a MindIE config with ``httpsEnabled: true`` serves mutual TLS (a client
without a certificate, or with one another CA signed, fails the handshake; plain HTTP gets
nowhere, so the API key never travels in cleartext); ``--ssl-certfile`` / ``--ssl-keyfile``
serve one-way TLS to the ``openai`` client given the CA bundle; and a config that asks for TLS
without usable files refuses to start, naming the file and the flag."""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from atb_plugin.server.cli import parse_config
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import REPO_ROOT, ServerProcess

MODEL = str(tiny_checkpoint("qwen2"))
KEY = "sekret"
CHAT = [{"role": "user", "content": "hi"}]


# -- throwaway PKI ------------------------------------------------------------------------------------

def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False,
                 server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key, password: bytes | None = None) -> bytes:
    encryption = (serialization.BestAvailableEncryption(password) if password
                  else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server and a client certificate, and a second CA with a client certificate,
    laid out as MindIE lays them out (security/ca, certs, keys, pass)."""
    root = tmp_path_factory.mktemp("pki")
    files = {}
    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("test CA", ca_key, _name("test CA"), ca_key, ca=True)
    other_ca = _certificate("other CA", other_ca_key, _name("other CA"), other_ca_key, ca=True)
    server_key, client_key, stranger_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    files["ca"] = _write(root / "security/ca/ca.pem", _pem(ca), 0o644)
    files["server_cert"] = _write(root / "security/certs/server.pem",
                                  _pem(_certificate("server", server_key, ca.subject, ca_key, server=True)), 0o644)
    files["server_key"] = _write(root / "security/keys/server.key.pem", _key_pem(server_key, b"pa55"))
    files["server_key_password"] = _write(root / "security/pass/key_pwd.txt", b"pa55\n")
    files["server_key_plain"] = _write(root / "plain/server.key.pem", _key_pem(server_key))
    files["client_cert"] = _write(root / "client/client.pem",
                                  _pem(_certificate("client", client_key, ca.subject, ca_key)), 0o644)
    files["client_key"] = _write(root / "client/client.key.pem", _key_pem(client_key))
    files["stranger_cert"] = _write(root / "client/stranger.pem",
                                    _pem(_certificate("stranger", stranger_key, other_ca.subject, other_ca_key)), 0o644)
    files["stranger_key"] = _write(root / "client/stranger.key.pem", _key_pem(stranger_key))
    files["root"] = str(root)
    return files


def client_context(pki, who: str | None = "client") -> ssl.SSLContext:
    """What a client connects with: trusts the test CA, presents ``who``'s certificate (None: none)."""
    context = ssl.create_default_context(cafile=pki["ca"])
    if who is not None:
        context.load_cert_chain(pki[f"{who}_cert"], pki[f"{who}_key"])
    return context


def mindie_config(pki, https: bool = True, **tls) -> str:
    """A MindIE config.json in the PKI's folder (its relative paths resolve from there)."""
    server = {"httpsEnabled": https, "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
              "tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem",
              "tlsPkPwd": "security/pass/key_pwd.txt", **tls}
    path = Path(pki["root"]) / f"config-{len(tls)}-{https}.json"
    path.write_text(json.dumps({"ServerConfig": server}), encoding="utf-8")
    return str(path)


# -- mutual TLS from a MindIE config -------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtls_server(serve, pki):
    with serve(MODEL, "--config", mindie_config(pki), api_key=KEY, client_tls=client_context(pki)) as server:
        yield server


def test_a_mindie_https_config_serves_mutual_tls_to_the_openai_client(mtls_server):
    reply = mtls_server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert reply.choices[0].message.content is not None
    assert "serving HTTPS (client certificates: required)" in mtls_server.log(tail=None)


def test_a_client_without_a_certificate_or_with_a_strangers_fails_the_handshake(mtls_server, pki):
    for context in (client_context(pki, None), client_context(pki, "stranger")):
        with pytest.raises(httpx.HTTPError):
            mtls_server.get("/v1/models", verify=context)
        client = openai.OpenAI(base_url=mtls_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=10,
                               http_client=httpx.Client(verify=context))
        with pytest.raises(openai.APIConnectionError):
            client.models.list()


def test_a_client_that_does_not_trust_the_servers_ca_refuses_it(mtls_server, pki):
    context = ssl.create_default_context()  # the system's CAs only
    context.load_cert_chain(pki["client_cert"], pki["client_key"])
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        mtls_server.get("/v1/models", verify=context)


def test_plain_http_to_the_tls_port_gets_no_answer_and_the_key_is_never_accepted(mtls_server):
    plain = mtls_server.base_url.replace("https://", "http://")
    try:
        response = httpx.get(plain + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    except httpx.HTTPError:
        return  # the TLS server hangs up on a cleartext request
    assert response.status_code == 400 and "models" not in response.text


# -- one-way TLS from flags ----------------------------------------------------------------------------

@pytest.mark.server
def test_flags_serve_https_to_a_client_that_trusts_the_ca(pki):
    args = ["--ssl-certfile", pki["server_cert"], "--ssl-keyfile", pki["server_key_plain"]]
    server = ServerProcess(MODEL, *args, client_tls=client_context(pki, None))
    try:
        reply = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
        assert reply.choices[0].text is not None
        assert "client certificates: none" in server.log(tail=None)
    finally:
        assert server.stop() == 0, server.log()


# -- no silent downgrade -------------------------------------------------------------------------------

@pytest.mark.server  # the command exits at once, but it is the server's
def test_https_asked_for_without_a_certificate_refuses_to_start(pki):
    config = mindie_config(pki, tlsCert="", tlsPk="")
    with pytest.raises(ValueError, match="HTTPS was asked for.*tlsCert.*--allow-insecure-http"):
        parse_config(["--model", MODEL, "--config", config])
    # The command itself exits non-zero with that message, before loading anything.
    result = subprocess.run([sys.executable, "-m", "atb_plugin.server", "--model", MODEL, "--config", config],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 2 and "HTTPS was asked for" in result.stderr
    # A certificate file that is not there: the error names it and the flag.
    missing = mindie_config(pki, tlsCert="security/certs/gone.pem")
    with pytest.raises(ValueError, match=r"--ssl-certfile .*security/certs/gone.pem: no such file"):
        parse_config(["--model", MODEL, "--config", missing])
    with pytest.raises(ValueError, match="--ssl-keyfile .*: no such file"):
        parse_config(["--model", MODEL, "--ssl-certfile", pki["server_cert"], "--ssl-keyfile", "/nonexistent.pem"])


def test_plain_http_despite_https_needs_the_override_and_never_carries_a_key(pki):
    config = mindie_config(pki, tlsCert="", tlsPk="")
    assert not parse_config(["--model", MODEL, "--config", config, "--allow-insecure-http"]).tls.enabled
    with pytest.raises(ValueError, match="--allow-insecure-http with an API key"):
        parse_config(["--model", MODEL, "--config", config, "--allow-insecure-http", "--api-key", KEY])
    with pytest.raises(ValueError, match="HTTPS was asked for"):
        parse_config(["--model", MODEL, "--require-https"])


def test_bad_tls_settings_are_start_up_errors(pki):
    with pytest.raises(ValueError, match="do not load"):  # the key of another certificate
        parse_config(["--model", MODEL, "--ssl-certfile", pki["server_cert"], "--ssl-keyfile", pki["client_key"]])
    with pytest.raises(ValueError, match="do not load"):  # an encrypted key without its password
        parse_config(["--model", MODEL, "--ssl-certfile", pki["server_cert"], "--ssl-keyfile", pki["server_key"]])
    with pytest.raises(ValueError, match="--ssl-cert-reqs required checks client certificates against --ssl-ca-certs"):
        parse_config(["--model", MODEL, "--ssl-certfile", pki["server_cert"], "--ssl-keyfile", pki["server_key_plain"],
                      "--ssl-cert-reqs", "required"])
    with pytest.raises(ValueError, match="given without --ssl-certfile"):
        parse_config(["--model", MODEL, "--ssl-ca-certs", pki["ca"]])
    config = parse_config(["--model", MODEL, "--ssl-certfile", pki["server_cert"], "--ssl-keyfile", pki["server_key"],
                           "--ssl-keyfile-password-file", pki["server_key_password"], "--ssl-ca-certs", pki["ca"],
                           "--ssl-cert-reqs", "2"])
    assert config.tls.cert_reqs == "required"


def test_a_key_file_others_can_read_is_a_warning_naming_it(pki, caplog):
    loose = Path(pki["root"]) / "loose.key.pem"
    _write(loose, Path(pki["server_key_plain"]).read_bytes(), 0o644)
    with caplog.at_level(logging.WARNING, logger="atb_plugin.server"):
        parse_config(["--model", MODEL, "--ssl-certfile", pki["server_cert"], "--ssl-keyfile", str(loose)])
    assert any(str(loose) in r.getMessage() and "0644" in r.getMessage() for r in caplog.records)


# -- issue 45: MindIE's default httpsEnabled, an over-long key password ---------------------------------

def _config_without_https_enabled(pki, name: str, **server) -> str:
    path = Path(pki["root"]) / name
    path.write_text(json.dumps({"ServerConfig": server}), encoding="utf-8")
    return str(path)


def test_tls_fields_without_https_enabled_serve_https_or_refuse_naming_them(pki, caplog):
    config = _config_without_https_enabled(
        pki, "no-https-enabled.json", tlsCaPath="security/ca/", tlsCaFile=["ca.pem"],
        tlsCert="security/certs/server.pem", tlsPk="security/keys/server.key.pem", tlsPkPwd="security/pass/key_pwd.txt")
    with caplog.at_level(logging.WARNING, logger="atb_plugin.server"):
        tls = parse_config(["--model", MODEL, "--config", config]).tls
    assert tls.enabled and tls.https_required and tls.cert_reqs == "required"
    assert any("httpsEnabled is absent" in r.getMessage() and "serving HTTPS" in r.getMessage()
               for r in caplog.records)
    # Certificates named but no server certificate among them: refused, naming the fields to set.
    ca_only = _config_without_https_enabled(pki, "ca-only.json", tlsCaPath="security/ca/", tlsCaFile=["ca.pem"])
    with pytest.raises(ValueError, match="HTTPS was asked for.*set tlsCert and tlsPk"):
        parse_config(["--model", MODEL, "--config", ca_only])


def test_an_over_long_key_password_names_the_file_and_the_field(pki):
    long_password = _write(Path(pki["root"]) / "security/pass/long_pwd.txt", b"k" * 1025 + b"\n")
    with pytest.raises(ValueError, match=rf"--ssl-keyfile-password-file \(MindIE tlsPkPwd\) {long_password}: "
                                         r"the password it holds is 1025 bytes, more than the 1024"):
        parse_config(["--model", MODEL, "--config", mindie_config(pki, tlsPkPwd="security/pass/long_pwd.txt")])
    # 1024 bytes and a newline: the newline is not part of the password (the key still fails: wrong password).
    _write(Path(long_password), b"k" * 1024 + b"\n")
    with pytest.raises(ValueError, match="do not load"):
        parse_config(["--model", MODEL, "--config", mindie_config(pki, tlsPkPwd="security/pass/long_pwd.txt")])
