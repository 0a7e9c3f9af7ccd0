"""Which machine a process runs on, and the nearest address of a server from here.

Below both the connection layer and ``deploy/``: a client picks a same-host unit or a
unix socket, a server reports its host, with the same ``host_id``. Callers look it up
as ``hosts.host_id()`` at each call, so a test that makes each Ray node a host of its
own replaces this module's ``host_id`` (``tests/helpers/fault_kit.own_hosts``).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any


def host_id() -> str:
    """Identifies this machine: clients with the same id may use shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def nearest(info: Mapping[str, Any]) -> str:
    """``nearest_of`` an address record (``{"address", "host"?, "local"?}``)."""
    return nearest_of(str(info["address"]), info.get("local"), info.get("host"))


def nearest_of(address: str, local: str | None, host: str | None) -> str:
    """The address to call a server at from this process: its unix ``local`` address
    when it has one and runs on this ``host``, else its ``address``."""
    return str(local) if local and host == host_id() else address
