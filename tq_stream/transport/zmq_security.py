"""CURVE keys for zmq sockets: encryption, plus an optional allowlist of clients.

With a server secret key, every connection is encrypted and only peers that
know the server's public key (and have their own key pair) can complete the
handshake. Optionally the server also admits only the client public keys it
was given (ZAP). Keys are z85 text, 40 characters, as ``zmq.curve_keypair()``
returns them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from tq_stream.errors import ConfigError

Key = bytes | str


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigError("CURVE keys were given, but this libzmq was built without CURVE")


def generate_keys() -> tuple[bytes, bytes]:
    """A new CURVE key pair ``(public, secret)``, z85-encoded.

    Example:
        >>> public, secret = generate_keys()
        >>> len(public), len(secret)
        (40, 40)
    """
    _require_curve()
    return zmq.curve_keypair()


def check_key(name: str, key: Any) -> bytes:
    """``key`` as z85 bytes, or raise ConfigError naming ``name``."""
    if isinstance(key, str):
        key = key.encode("ascii", "replace")
    if not isinstance(key, bytes) or len(key) != 40:
        raise ConfigError(f"{name} must be a 40-character z85 CURVE key, got {key!r}")
    return key


def public_key(secret_key: Key) -> bytes:
    """The public key that belongs to ``secret_key`` (give it to clients)."""
    _require_curve()
    return zmq.curve_public(check_key("secret_key", secret_key))


def make_curve_server(sock: zmq.Socket[bytes], secret_key: Key) -> None:
    """Make ``sock`` (before bind) accept only CURVE clients that know its public key."""
    _require_curve()
    secret = check_key("curve_secret_key", secret_key)
    sock.curve_secretkey = secret
    sock.curve_publickey = zmq.curve_public(secret)
    sock.curve_server = True


def make_curve_client(
    sock: zmq.Socket[bytes], server_key: Key, public: Key | None = None, secret: Key | None = None
) -> None:
    """Make ``sock`` (before connect) talk CURVE to the server with ``server_key``.

    Without a client key pair a fresh one is generated (enough unless the server
    restricts clients with an allowlist).
    """
    _require_curve()
    if (public is None) != (secret is None):
        raise ConfigError("curve_public_key and curve_secret_key must be given together")
    if public is None:
        public, secret = zmq.curve_keypair()
    sock.curve_serverkey = check_key("curve_server_key", server_key)
    sock.curve_publickey = check_key("curve_public_key", public)
    sock.curve_secretkey = check_key("curve_secret_key", secret)


class _Allowed:
    """ZAP credentials provider: a fixed set of client public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def start_client_allowlist(context: zmq.Context[zmq.Socket[bytes]],
                           client_keys: Iterable[Key]) -> ThreadAuthenticator:
    """Admit only CURVE clients whose public key is in ``client_keys``.

    Must run before the server socket binds; stop it before terminating ``context``.
    """
    _require_curve()
    keys = frozenset(check_key("curve_client_keys item", k) for k in client_keys)
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_Allowed(keys))
    return auth


def is_loopback(address: str) -> bool:
    """True for a ``tcp://`` endpoint on a loopback interface, and for non-tcp
    endpoints (``ipc://``, ``inproc://``: this host only)."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface or host name: may be reachable from elsewhere


def check_bind(address: str, secure: bool, allow_insecure: bool) -> None:
    """Refuse to serve unencrypted where other hosts can connect, unless asked to.

    Raises:
        ConfigError: ``address`` is not loopback, no CURVE key is set and
            ``allow_insecure`` is False.
    """
    if secure or allow_insecure or is_loopback(address):
        return
    raise ConfigError(
        f"address must be loopback (127.0.0.1) without CURVE encryption, got {address!r}: "
        "anyone who can reach it could read and write every row. Pass curve=True, or "
        "allow_insecure_tcp=True if the network is trusted")
