"""Authentication between machines from one shared secret (`--cluster-secret`).

Two uses, one secret:

- ZeroMQ CURVE on the data plane. Every rank derives the same server and client key pairs from the
  secret (HMAC-SHA256 of a label, as the Curve25519 secret key; its public key from libsodium), so
  no key is ever exchanged or written down. A PULL socket is a CURVE server; a peer completes the
  handshake only if it knows the server's public key, which only holders of the secret can derive,
  and the server's ZAP check (zmq.auth) admits only the derived client key. Everything after the
  handshake is encrypted and authenticated per message. CURVE rather than an HMAC challenge of our
  own: ZeroMQ does the handshake, the encryption and the refusal of other mechanisms below our code,
  on every reconnect, and a peer that never authenticates never reaches the receive loop.
- HMAC-SHA256 signatures on what ranks publish at the rendezvous (torch's TCPStore, which has no
  authentication of its own): an entry that does not carry the secret's signature is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass, field

ENV = "AFD_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class ClusterKeys:
    """The keys of one deployment, derived from its secret (picklable; the secret never shows in a repr)."""

    secret: bytes = field(repr=False)

    def _derive(self, label: str) -> bytes:
        return hmac.new(self.secret, f"afd cluster {label}".encode(), hashlib.sha256).digest()

    def _pair(self, label: str) -> tuple[bytes, bytes]:
        """(public, secret) Z85-encoded Curve25519 keys."""
        import zmq
        from zmq.utils import z85

        secret = z85.encode(self._derive(label))
        return zmq.curve_public(secret), secret

    @property
    def server(self) -> tuple[bytes, bytes]:
        return self._pair("curve server")

    @property
    def client(self) -> tuple[bytes, bytes]:
        return self._pair("curve client")

    def sign(self, text: str) -> str:
        """`text` with its signature appended (what a rank publishes at the rendezvous)."""
        mac = hmac.new(self._derive("rendezvous"), text.encode(), hashlib.sha256).hexdigest()
        return f"{text}#{mac}"

    def verify(self, signed: str) -> str | None:
        """The text of a signed value, or None when its signature is not this secret's."""
        text, sep, mac = signed.rpartition("#")
        if not sep:
            return None
        want = hmac.new(self._derive("rendezvous"), text.encode(), hashlib.sha256).hexdigest()
        return text if hmac.compare_digest(mac, want) else None


def cluster_keys(secret: str | None) -> ClusterKeys | None:
    """The keys of `secret` (the flag's value, else $AFD_CLUSTER_SECRET); None when neither is set."""
    secret = secret or os.environ.get(ENV) or None
    if secret is None:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret must have at least {MIN_SECRET_CHARS} characters")
    return ClusterKeys(secret.encode())


def is_loopback(address: str) -> bool:
    """Whether "host:port" names this machine only (127.0.0.0/8, ::1, localhost)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def secure_socket(sock, keys: ClusterKeys | None, server: bool) -> None:
    """Makes a ZeroMQ socket a CURVE server (binding side) or client (connecting side) of `keys`;
    nothing without keys. Call before bind/connect."""
    if keys is None:
        return
    import zmq

    server_public, server_secret = keys.server
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, b"afd")
    else:
        client_public, client_secret = keys.client
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, client_secret)


def start_authenticator(ctx, keys: ClusterKeys):
    """The ZAP handler of `ctx`: admits only the deployment's client key (and logs who it denies).
    Keep the returned object; stop() it before the context terminates."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=_auth_log())
    auth.start()
    auth.configure_curve_callback(domain="afd", credentials_provider=_OnlyKey(keys.client[0]))
    return auth


class _OnlyKey:
    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


def _auth_log():
    import logging

    return logging.getLogger("comm.auth")
