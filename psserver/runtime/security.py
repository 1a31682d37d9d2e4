"""The trust model, enforced in one place (ARCHITECTURE.md, "Trust model").

- **The cluster token is never sent.** A caller presents a credential derived
  from it (``authorization: Bearer <HMAC-SHA256(token, "paramserve/v1/call")>``),
  so whatever answers at an address learns that credential, not the token.
- **Signed replies.** A caller that sends a nonce (``paramserve-reply-nonce``)
  gets its reply signed with another key derived from the token
  (``paramserve-reply-signature``: HMAC-SHA256 over the method, the nonce and the
  reply's bytes). The coordinator unpickles a worker's reply only when that
  signature holds, so a process at a worker's address that does not hold the
  token cannot make the coordinator run code, nor replay an old reply.
- **Where the token comes from.** A file (``read_token_file``: ``--token-file``), else
  ``PARAMSERVE_TOKEN`` (``TOKEN_ENV``); an empty one is an error (``check_token``).
- **Exposure.** A server listens beyond loopback only when its callers must
  authenticate (a token, or client certificates), unless told ``insecure``.
- **TLS.** What a server presents and which client certificates it requires
  (``TlsConfig``, its files checked before serving by ``tls_files_problem``); what a client
  verifies servers with and presents (``ClientTls``).
- **Checkpoint paths.** Save and Restore stay inside the server's checkpoint root.
- **The dense group's rendezvous store.** Members prove they hold a key derived from the token
  and the store's session secret (``rendezvous_key``) before it answers them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import pathlib
import secrets
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from paramserve.psserver.protocol.errors import ConfigurationError, InvalidRequestError, PermissionDeniedError

__all__ = [
    "AUTH_METADATA_KEY",
    "REPLY_NONCE_METADATA_KEY",
    "REPLY_SIGNATURE_METADATA_KEY",
    "TOKEN_ENV",
    "ClientTls",
    "TlsConfig",
    "bearer_metadata",
    "check_exposure",
    "check_token",
    "checkpoint_root",
    "confined_path",
    "is_loopback",
    "new_reply_nonce",
    "read_token_file",
    "reply_is_signed",
    "reply_key",
    "reply_signature",
    "rendezvous_key",
    "tls_files_problem",
    "unauthenticated_workers",
    "writable_directory",
]

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
REPLY_NONCE_METADATA_KEY = "paramserve-reply-nonce"
REPLY_SIGNATURE_METADATA_KEY = "paramserve-reply-signature"
_CALL_CONTEXT = b"paramserve/v1/call"
_REPLY_CONTEXT = b"paramserve/v1/reply"
_NONCE_CHARS = 32
MIN_TOKEN_CHARS = 16
"""Shorter tokens work, with a warning: a captured credential lets anyone try guesses offline."""
MAX_PATH_BYTES = 4096
"""Longest checkpoint path a request may name (Linux's PATH_MAX)."""


# ---------------------------------------------------------------- the token


def check_token(token: str | None, source: str) -> str | None:
    """``token`` when it can authenticate a cluster, None for none.

    Raises ConfigurationError for an empty token (an empty ``PARAMSERVE_TOKEN`` once meant
    "no authentication" without a word); warns for one shorter than MIN_TOKEN_CHARS.
    ``source`` names where it came from, for the messages.
    """
    if token is None:
        return None
    if not token.strip():
        raise ConfigurationError(
            f"{source} is empty: write the cluster's shared token there (e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`), or leave it unset to run "
            "without authentication on 127.0.0.1 only"
        )
    if len(token) < MIN_TOKEN_CHARS:
        log.warning(
            "the token from %s has %d characters: one of %d or more random characters resists "
            "guessing from a captured credential",
            source,
            len(token),
            MIN_TOKEN_CHARS,
        )
    return token


TOKEN_ENV = "PARAMSERVE_TOKEN"
"""The environment variable a process reads the cluster's token from, when no file names it."""


def read_token_file(path: pathlib.Path, flag: str = "--token-file") -> str:
    """The token in ``path``; raises ConfigurationError when it cannot be read or is empty."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigurationError(
            f"{flag} {path}: cannot read it ({reason}); give a file holding the cluster's shared token"
        ) from None
    token = check_token(text, f"{flag} {path}")
    assert token is not None
    return token


@functools.lru_cache(maxsize=16)
def _call_credential(token: str) -> str:
    return hmac.new(token.encode(), _CALL_CONTEXT, hashlib.sha256).hexdigest()


def bearer_metadata(token: str) -> tuple[str, str]:
    """The metadata entry a caller holding ``token`` presents: a credential derived from it."""
    return AUTH_METADATA_KEY, f"Bearer {_call_credential(token)}"


def reply_key(token: str) -> bytes:
    """The key replies are signed with (derived from the token; never sent)."""
    return hmac.new(token.encode(), _REPLY_CONTEXT, hashlib.sha256).digest()


def new_reply_nonce() -> str:
    """A fresh nonce for one call: its reply's signature covers it, so an old reply does not verify."""
    return secrets.token_hex(_NONCE_CHARS // 2)


def is_reply_nonce(value: str) -> bool:
    return len(value) == _NONCE_CHARS and all(c in "0123456789abcdef" for c in value)


def reply_signature(key: bytes, method: str, nonce: str, body: bytes) -> str:
    """HMAC-SHA256 of (method, nonce, reply bytes) under ``key``, hex."""
    mac = hmac.new(key, method.encode(), hashlib.sha256)
    mac.update(b"\0" + nonce.encode() + b"\0")
    mac.update(body)
    return mac.hexdigest()


def reply_is_signed(key: bytes, method: str, nonce: str, body: bytes, signature: str | None) -> bool:
    """Whether ``signature`` is the reply signature of ``body`` for this call (constant-time)."""
    if not signature:
        return False
    return hmac.compare_digest(signature.encode(), reply_signature(key, method, nonce, body).encode())


# ---------------------------------------------------------------- the data plane's handshake

_DATA_PLANE_CONTEXT = b"paramserve/v1/data-plane"
HANDSHAKE_NONCE_BYTES = 32
HANDSHAKE_PROOF_BYTES = 32


@dataclass(frozen=True)
class DataPlaneKey:
    """Mutual, non-replayable authentication of a data-plane connection, both sides holding the
    cluster's token. The client sends a fresh nonce (HELLO); the server answers with its own
    nonce and a proof over both (CHALLENGE); the client checks that proof before it sends its
    own over both (PROOF), in the other direction. So a listener without the token (one that
    took the server's address or local socket) proves nothing and learns nothing it can replay,
    and a captured exchange is worthless on the next connection, whose server nonce differs."""

    key: bytes

    @staticmethod
    def of(token: str) -> DataPlaneKey:
        return DataPlaneKey(hmac.new(token.encode(), _DATA_PLANE_CONTEXT, hashlib.sha256).digest())

    def server_proof(self, client_nonce: bytes, server_nonce: bytes) -> bytes:
        return self._proof(b"server", client_nonce, server_nonce)

    def client_proof(self, client_nonce: bytes, server_nonce: bytes) -> bytes:
        return self._proof(b"client", client_nonce, server_nonce)

    def _proof(self, side: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
        return hmac.new(self.key, side + b"\0" + client_nonce + server_nonce, hashlib.sha256).digest()


_RENDEZVOUS_CONTEXT = b"paramserve/v1/dense-rendezvous"
RENDEZVOUS_SESSION_BYTES = 32


def rendezvous_key(token: str | None, session: bytes) -> DataPlaneKey:
    """The key of hybrid training's rendezvous store (coordinator/dispatch/rendezvous_server.py):
    the store and each member prove it to the other with the data plane's handshake before the
    store answers anything. Derived from the cluster's token, never sent, and from ``session``, the
    store's random secret, which the coordinator sends members in each round (the DenseGroup
    message): so a process at a worker's address that receives a round without holding the token
    still cannot join, a cluster without a token still has a store only its members can use, and
    nothing learnt from one coordinator's store opens the next one's."""
    base = hmac.new(token.encode(), _RENDEZVOUS_CONTEXT, hashlib.sha256).digest() if token else b""
    return DataPlaneKey(hmac.new(session, _RENDEZVOUS_CONTEXT + b"\0" + base, hashlib.sha256).digest())


def new_handshake_nonce() -> bytes:
    return secrets.token_bytes(HANDSHAKE_NONCE_BYTES)


def proofs_match(given: bytes | memoryview, expected: bytes) -> bool:
    """Whether a proof from the peer is the expected one (constant-time)."""
    return hmac.compare_digest(bytes(given), expected)


# ---------------------------------------------------------------- who may reach a server


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address a server binds, or a host a client calls) is this machine only.

    Literal loopback addresses and "localhost"; anything else (a name that may resolve
    elsewhere, or a wildcard such as 0.0.0.0) is not.
    """
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, *, authenticated: bool, insecure: bool) -> str | None:
    """Decides whether a server may listen on ``host``: None when it may, the warning to log
    when only ``insecure`` allows it. Raises ConfigurationError when it may not: a server
    beyond loopback that anyone can call (a worker runs whatever code it is sent)."""
    if authenticated or is_loopback(host):
        return None
    if insecure:
        return (
            f"listening on {host} without authentication (--insecure): anyone who can reach this port "
            "can call it, and a worker runs any code it is sent"
        )
    raise ConfigurationError(
        f"refusing to listen on {host} without authentication: anyone who can reach it could call this "
        "server (a worker runs any code it is sent). Give the cluster's token (--token-file or "
        "PARAMSERVE_TOKEN), require client certificates (--tls-client-ca), listen on 127.0.0.1, or "
        "pass --insecure to accept the risk"
    )


def unauthenticated_workers(addresses: Sequence[str], *, token: str | None, tls: ClientTls | None) -> list[str]:
    """The worker addresses whose replies nothing would authenticate: without a token (which
    signs replies) and without TLS (which verifies the worker's certificate), only a worker on
    this machine's loopback is trusted."""
    if token or tls is not None:
        return []
    return [address for address in addresses if not is_loopback(address.rsplit(":", 1)[0])]


# ---------------------------------------------------------------- TLS


def _read(path: pathlib.Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigurationError(f"cannot read the {what} {path}: {err.strerror or err}; check the path") from None


@dataclass(frozen=True)
class TlsConfig:
    """A server's TLS: its certificate chain and key (PEM); with ``client_ca_file``, clients
    must present certificates signed by it (mutual TLS)."""

    cert_file: pathlib.Path
    key_file: pathlib.Path
    client_ca_file: pathlib.Path | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Raises ConfigurationError naming a file that cannot be read."""
        ca = _read(self.client_ca_file, "client CA bundle (--tls-client-ca)") if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(_read(self.key_file, "TLS key (--tls-key)"), _read(self.cert_file, "TLS certificate (--tls-cert)"))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


@dataclass(frozen=True)
class ClientTls:
    """How a process calls servers over TLS: the CA bundle it verifies their certificates
    with and, for servers that require mutual TLS, the certificate chain and key it presents.
    ``server_name`` checks the certificate for that name instead of the address's host."""

    root_certificates: pathlib.Path
    cert_chain: pathlib.Path | None = None
    private_key: pathlib.Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ConfigurationError(
                "a client certificate needs both its chain and its key (e.g. --tls-cert and "
                "--tls-key); give both or neither"
            )

    def credentials(self) -> grpc.ChannelCredentials:
        """Raises ConfigurationError naming a file that cannot be read."""
        chain = _read(self.cert_chain, "client certificate") if self.cert_chain else None
        key = _read(self.private_key, "client key") if self.private_key else None
        return grpc.ssl_channel_credentials(_read(self.root_certificates, "CA bundle"), key, chain)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def tls_files_problem(cert: pathlib.Path, key: pathlib.Path, client_ca: pathlib.Path | None) -> str | None:
    """What is wrong with a server's TLS files, or None: checked before serving, so that a bad
    certificate is not reported as a port that cannot be bound."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(cert), str(key))
    except FileNotFoundError as err:
        return f"--tls-cert/--tls-key: {err.filename} does not exist"
    except (ssl.SSLError, OSError) as err:
        return (
            f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate chain and its private key "
            f"({getattr(err, 'reason', None) or err}): give the files your CA issued for this server"
        )
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=str(client_ca))
        except (ssl.SSLError, OSError) as err:
            return f"--tls-client-ca {client_ca} is not a PEM CA bundle ({getattr(err, 'reason', None) or err})"
    return None


# ---------------------------------------------------------------- checkpoint paths


def checkpoint_root(path: pathlib.Path) -> pathlib.Path:
    """The root as Save and Restore compare paths with it (symbolic links resolved)."""
    return pathlib.Path(os.path.realpath(path))


def writable_directory(path: pathlib.Path, flag: str) -> pathlib.Path:
    """``path``, created if missing, once a file could be written in it; raises
    ConfigurationError naming ``flag`` otherwise. For checking a checkpoint directory
    before anything starts, rather than at the first save after training."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".paramserve-write-check-"):
            pass
    except OSError as err:
        raise ConfigurationError(
            f"{flag} {path}: cannot write there ({err.strerror or err}); choose a directory this user may write"
        ) from None
    return path


def confined_path(root: pathlib.Path | None, requested: str, *, authenticated: bool) -> pathlib.Path:
    """Where a Save or Restore request may act, symbolic links resolved: ``requested`` under
    ``root`` (a relative path is taken from it) when the server has a checkpoint root; any
    path when it has none but its callers authenticate (token holders are trusted with the
    server's files, as they are with its variables).

    Raises PermissionDeniedError for a path outside the root, or for any path on a server with
    neither a root nor authentication; InvalidRequestError for an empty path, a NUL byte or a
    path over MAX_PATH_BYTES.
    """
    if not requested:
        raise InvalidRequestError("a checkpoint path is needed (relative to the server's checkpoint root)")
    if "\0" in requested:
        raise InvalidRequestError("the checkpoint path contains a NUL byte, which no file name can; remove it")
    size = len(requested.encode("utf-8", "surrogateescape"))
    if size > MAX_PATH_BYTES:
        raise InvalidRequestError(
            f"the checkpoint path has {size} bytes; the limit is {MAX_PATH_BYTES}: choose a shorter path"
        )
    if root is None:
        if authenticated:
            return pathlib.Path(os.path.realpath(requested))
        raise PermissionDeniedError(
            "this parameter server has no token, so it saves and restores only under its checkpoint root: "
            "start it with --checkpoint-root DIR (then name paths under DIR), or with a token"
        )
    resolved = pathlib.Path(os.path.realpath(root / requested))  # an absolute path replaces root
    if not resolved.is_relative_to(root):
        raise PermissionDeniedError(
            f"checkpoint path {requested!r} is outside this server's checkpoint root {root}; "
            "name a path under it (a relative path is taken from it)"
        )
    return resolved
