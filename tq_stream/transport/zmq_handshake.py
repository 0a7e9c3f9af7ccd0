"""check_handshake: tell a CURVE key mismatch at once, instead of a call's timeout.

A zmq client whose CURVE settings do not match the server's (another server key, a
key for a server without CURVE, none for a server that requires it) sends requests
into the void: zmq drops the connection during the handshake and retries forever,
so a call would only time out. The socket monitor reports the failed handshake
within milliseconds; ``connect`` asks it once, before its first call.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from tq_stream.errors import ConfigError
from tq_stream.transport.zmq_security import make_curve_client

HANDSHAKE_WINDOW = 5.0  # seconds to wait for the handshake's outcome (no server: no outcome)
_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
           zmq.EVENT_HANDSHAKE_FAILED_AUTH}


def check_handshake(address: str, curve_server_key: bytes | None,
                    window: float = HANDSHAKE_WINDOW) -> None:
    """Raise ConfigError naming ``curve_server_key`` if the zmq server at ``address``
    refuses the handshake with it; return when it succeeds, or when no server answered
    within ``window`` seconds (the first call then reports that)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    monitor = None
    try:
        sock.linger = 0
        if curve_server_key is not None:
            make_curve_client(sock, curve_server_key)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(_FAILED))
        sock.connect(address)
        deadline = time.monotonic() + window
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(max(1, int(left * 1000))):
                return
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event in _FAILED:
                raise ConfigError(_mismatch(address, curve_server_key))
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)


def _mismatch(address: str, key: bytes | None) -> str:
    if key is None:
        return (f"curve_server_key must be given for the deployment at {address}: it "
                f"requires CURVE and refused a connection without a key (pass its "
                f"stream.curve_server_key), got None")
    return (f"curve_server_key must be the public key of the deployment at {address} "
            f"(its stream.curve_server_key), or None if it does not use CURVE: it refused "
            f"the CURVE handshake with the key given, got {key!r}")
