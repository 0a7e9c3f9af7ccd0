"""Unix socket addresses: ``unix:///path`` to a file path, and binding a path that a
killed server left behind."""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

from tq_stream.errors import ConfigError

SCHEME = "unix://"


def unix_path(address: Any) -> str:
    """The file path of a ``unix://`` address (ConfigError if it is not one)."""
    if not isinstance(address, str) or not address.startswith(SCHEME) or \
            len(address) == len(SCHEME):
        raise ConfigError(f"address must look like 'unix:///path/to/socket', got {address!r}")
    path = address[len(SCHEME):]
    if len(path.encode()) > 100:
        raise ConfigError(f"address must name a socket path of at most 100 bytes (a unix "
                          f"socket limit), got {len(path.encode())} bytes: {address!r}")
    return path


def bind_path(sock: socket.socket, path: str) -> None:
    """Bind ``sock`` to ``path``; a socket file no server listens on any more (its
    server was killed) is replaced, a live one is not."""
    try:
        sock.bind(path)
        return
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # stale: left by a server that died
    except OSError:
        pass
    else:
        raise OSError(errno.EADDRINUSE, "a server is listening there")
    finally:
        probe.close()
    sock.bind(path)
