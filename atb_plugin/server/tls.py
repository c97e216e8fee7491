"""HTTPS and mutual TLS: the server's certificate settings, checked at start-up, as an ``SSLContext``.

    --ssl-certfile / --ssl-keyfile (+ --ssl-keyfile-password-file)   the server's certificate chain
    --ssl-ca-certs (repeatable)        CAs that sign client certificates
    --ssl-cert-reqs none | optional | required    required = mutual TLS: no client certificate, or
                                       one another CA signed, fails the handshake
    --ssl-crl (repeatable)             revoked client certificates (CRL files, PEM): checked for
                                       the client's own certificate (the leaf)

MindIE's ``httpsEnabled`` / ``tlsCert`` / ``tlsPk`` / ``tlsPkPwd`` / ``tlsCaPath`` + ``tlsCaFile`` /
``tlsCrlPath`` + ``tlsCrlFiles`` map onto these (``mindie_config``). The rule: **never downgrade a
secure config silently.** A config that asks for HTTPS without usable files is a start-up error
naming the file and the flag; plain HTTP despite ``httpsEnabled: true`` happens only with
``--allow-insecure-http``, logged as an error-level line, and never with an API key (it would
travel in cleartext). A key file others may read (mode wider than 0600) is a warning naming it.

uvicorn terminates TLS: the ``SSLContext`` made here is handed to it (``ssl_context_factory``),
so the stdlib does the handshake; TLS 1.2 is the oldest version accepted.
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
from dataclasses import dataclass

logger = logging.getLogger("atb_plugin.server")

__all__ = ["CERT_REQS", "TLSSettings", "check_tls", "server_ssl_context"]

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class TLSSettings:
    """What the server's TLS is asked to be (``ServerConfig.tls``); ``https_required``: the
    operator asked for HTTPS (MindIE's ``httpsEnabled: true``), so serving without it is an error
    unless ``allow_insecure_http``."""

    certfile: str | None = None
    keyfile: str | None = None
    keyfile_password_file: str | None = None
    ca_certs: tuple[str, ...] = ()
    cert_reqs: str = "none"
    crl: tuple[str, ...] = ()
    https_required: bool = False
    allow_insecure_http: bool = False

    def __post_init__(self):
        object.__setattr__(self, "ca_certs", tuple(self.ca_certs))
        object.__setattr__(self, "crl", tuple(self.crl))
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"--ssl-cert-reqs = {self.cert_reqs!r}: must be one of {', '.join(CERT_REQS)}")

    @property
    def enabled(self) -> bool:
        return self.certfile is not None


def _readable_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path}: not readable by this process")


def _warn_if_others_can_read(path: str, flag: str) -> None:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        logger.warning("%s %s has mode %04o: others may read this private key file; chmod 600 it", flag, path, mode)


def check_tls(tls: TLSSettings, api_key: str | None) -> None:
    """Start-up checks (``ValueError`` naming the file and the flag): every file there and
    readable, the pieces consistent, the certificate and key loadable, no silent downgrade."""
    if not tls.enabled:
        if tls.https_required:
            if not tls.allow_insecure_http:
                raise ValueError("HTTPS was asked for (MindIE httpsEnabled: true, its default when the config names "
                                 "tls* files, or --require-https) but no server certificate was given: set tlsCert "
                                 "and tlsPk in the config (or --ssl-certfile / --ssl-keyfile); to serve plain HTTP "
                                 "anyway, pass --allow-insecure-http")
            if api_key:
                raise ValueError("--allow-insecure-http with an API key: HTTPS was asked for, and the key would "
                                 "travel in cleartext over plain HTTP; give the server a certificate instead")
            return  # the override: cli.serve logs it as an error
        orphans = [flag for flag, value in (("--ssl-keyfile", tls.keyfile), ("--ssl-ca-certs", tls.ca_certs),
                                            ("--ssl-keyfile-password-file", tls.keyfile_password_file),
                                            ("--ssl-crl", tls.crl)) if value]
        if orphans or tls.cert_reqs != "none":
            given = orphans + (["--ssl-cert-reqs"] if tls.cert_reqs != "none" else [])
            raise ValueError(f"{', '.join(given)} given without --ssl-certfile: HTTPS needs the server's certificate "
                             "(--ssl-certfile, and --ssl-keyfile unless the key is in the same file)")
        return
    _readable_file(tls.certfile, "--ssl-certfile")
    if tls.keyfile is not None:
        _readable_file(tls.keyfile, "--ssl-keyfile")
        _warn_if_others_can_read(tls.keyfile, "--ssl-keyfile")
    if tls.keyfile_password_file is not None:
        _readable_file(tls.keyfile_password_file, "--ssl-keyfile-password-file")
        _warn_if_others_can_read(tls.keyfile_password_file, "--ssl-keyfile-password-file")
    for path in tls.ca_certs:
        _readable_file(path, "--ssl-ca-certs")
    for path in tls.crl:
        _readable_file(path, "--ssl-crl")
    if tls.cert_reqs != "none" and not tls.ca_certs:
        raise ValueError(f"--ssl-cert-reqs {tls.cert_reqs} checks client certificates against --ssl-ca-certs; "
                         "give the CA file(s) that sign them")
    if tls.crl and tls.cert_reqs == "none":
        raise ValueError("--ssl-crl revokes client certificates, which --ssl-cert-reqs none never asks for; "
                         "set --ssl-cert-reqs optional or required")
    server_ssl_context(tls)  # the certificate, key, password, CAs and CRLs load, or the error says which


# The longest key password the stdlib hands OpenSSL (its PEM_BUFSIZE): a longer one fails inside
# load_cert_chain with a message that names neither the file nor the setting.
MAX_KEY_PASSWORD_BYTES = 1024


def _password(tls: TLSSettings) -> str | None:
    if tls.keyfile_password_file is None:
        return None
    with open(tls.keyfile_password_file, encoding="utf-8") as file:
        password = file.read().rstrip("\r\n")
    size = len(password.encode("utf-8"))
    if size > MAX_KEY_PASSWORD_BYTES:
        # MindIE's tlsPkPwd usually holds a KMC-encrypted password, which is long: say so.
        raise ValueError(f"--ssl-keyfile-password-file (MindIE tlsPkPwd) {tls.keyfile_password_file}: the password "
                         f"it holds is {size} bytes, more than the {MAX_KEY_PASSWORD_BYTES} OpenSSL accepts; the file "
                         "must hold the key's plain password on one line (MindIE's KMC-encrypted form cannot be "
                         "read here)")
    return password


def server_ssl_context(tls: TLSSettings) -> ssl.SSLContext:
    """The server side of the handshake, from settings ``check_tls`` accepted."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    password = _password(tls)
    try:
        context.load_cert_chain(tls.certfile, tls.keyfile, (lambda: password) if password is not None else None)
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"--ssl-certfile {tls.certfile} / --ssl-keyfile {tls.keyfile}: the certificate and key "
                         f"do not load ({error}); check that they match and the key password "
                         "(--ssl-keyfile-password-file)") from None
    for path in tls.ca_certs:
        try:
            context.load_verify_locations(cafile=path)
        except (ssl.SSLError, OSError) as error:
            raise ValueError(f"--ssl-ca-certs {path}: not a PEM CA certificate file ({error})") from None
    for path in tls.crl:
        try:
            context.load_verify_locations(cafile=path)
        except (ssl.SSLError, OSError) as error:
            raise ValueError(f"--ssl-crl {path}: not a PEM certificate revocation list ({error})") from None
    if tls.crl:
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    context.verify_mode = CERT_REQS[tls.cert_reqs]
    return context
