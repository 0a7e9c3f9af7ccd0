"""Serving a controller or a storage unit: in a child process, or a Ray actor.

``python -m tq_stream.deploy.server`` (settings as JSON on stdin) runs one
service until SIGTERM/SIGINT, or until its parent dies: the parent holds the
write end of a pipe whose read end the child watches, so even a SIGKILLed
parent leaves no orphans (and Linux's PR_SET_PDEATHSIG backs that up). The
child prints one JSON line with its address once it serves.

The signal path takes no lock: a dying multi-threaded parent can send the
parent-death signal several times (once per thread the child is reparented to),
and a Python handler runs again inside itself when a signal arrives while it
runs, so a handler that took a lock (``Event.set``) could deadlock the main
thread for good. Signals only write a byte to a wakeup pipe (``set_wakeup_fd``)
that the main thread polls together with the lifeline.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import json
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO, TypedDict

from tq_stream.config import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from tq_stream.transport.base import Transport

STOP_GRACE = 1.0  # seconds a stopping server waits for handlers still running
EXIT_GRACE = 10.0  # seconds the whole stop may take before the process exits anyway

# Bytes one request may carry (``max_message``): the controller receives metadata only;
# a unit receives the rows of one put (a larger put is split by the caller or refused).
MAX_MESSAGE = {"controller": 64 << 20, "unit": 4 << 30}
WORKERS = {"controller": 128, "unit": 16}  # threads running one server's requests (a waiting
# consumer's get_meta is one long-poll that holds a controller worker for its whole wait)
# Long-polls of each wait class (``ControllerService.RPC_TABLE.waits``) that run at once: the
# other 16 workers always serve calls that never wait (puts, acks), and more waiting
# consumers than the cap are parked without a thread (``transport.wait_slots``).
WAIT_CAPS = {"controller": {"consume": 96, "produce": 16}}


class ServerBounds(TypedDict):
    """What every server of one service is given (``transport.rpc.rpc_server``)."""

    workers: int
    backlog: int
    owner_token: str | None
    max_message: int | None
    wait_caps: Mapping[str, int] | None


def build_service(role: str, units: int = 1, sampler_modules: tuple[str, ...] = (),
                  storage: str = "shm", timeout: float = DEFAULT_TIMEOUT,
                  curve_server_key: bytes | None = None,
                  owner_token: str | None = None, unit_timeout: float | None = None,
                  checkpoint: tuple[str | None, float | None] = (None, None),
                  owner: dict[str, Any] | None = None,
                  spill_dir: str | None = None) -> tuple[Any, Any]:
    """The handler for ``role`` and a cleanup callable (``storage``: a unit's kind in
    ``tq_stream.backends.kinds``; ``spill_dir``: where a unit spills; ``unit_timeout``:
    seconds a controller waits for a silent unit before it is lost; None: the default;
    ``owner``: the process that restarts the servers, which the controller's ``ping``
    reports)."""
    from tq_stream.deploy.services import ControllerService, UnitService

    if role == "unit":
        from tq_stream.backends.kinds import make_unit

        unit = make_unit(storage, spill_dir)
        return UnitService(unit), unit.close
    from tq_stream.transport.rpc import rpc_client

    def client(address: str) -> Transport:
        return rpc_client(address, timeout=timeout, curve_server_key=curve_server_key)

    from tq_stream.deploy.unit_watch import DEFAULT_UNIT_TIMEOUT

    service = ControllerService(units, sampler_modules, unit_client=client,
                                owner_token=owner_token,
                                unit_timeout=unit_timeout or DEFAULT_UNIT_TIMEOUT,
                                checkpoint_path=checkpoint[0],
                                checkpoint_interval=checkpoint[1], owner=owner)
    return service, service.close


def log_warnings_to_stderr() -> None:
    """A server process whose logging nobody configured (a spawned child, a Ray actor)
    writes the package's WARNINGs to stderr, which the owner or Ray shows; a forked
    child keeps the handlers it inherited from the owner."""
    root, pkg = logging.getLogger(), logging.getLogger("tq_stream")
    if root.handlers or any(not isinstance(h, logging.NullHandler) for h in pkg.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s tq_stream[{os.getpid()}] %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    pkg.addHandler(handler)


def serve(role: str, address: str, units: int = 1, sampler_modules: tuple[str, ...] = (),
          storage: str = "shm", curve_secret_key: bytes | None = None,
          curve_server_key: bytes | None = None, local_dir: str | None = None,
          owner_token: str | None = None, max_message: int | None = None,
          allow_insecure: bool = False, unit_timeout: float | None = None,
          checkpoint: tuple[str | None, float | None] = (None, None),
          owner: dict[str, Any] | None = None,
          spill_dir: str | None = None) -> tuple[Any, Any, str | None]:
    """Start serving ``role`` at ``address``; returns (server, cleanup, local address).

    With ``local_dir`` (and no CURVE key) the same service is also served on a unix
    socket in that folder, for clients on this host (Ray mode: the tcp address is for
    other nodes); its address is returned, else None. ``owner_token`` authorizes admin
    calls (``tq_stream.transport.dispatch``); ``max_message`` bounds one request's
    bytes (default ``MAX_MESSAGE[role]``).
    """
    from tq_stream.transport.rpc import rpc_server

    log_warnings_to_stderr()
    service, cleanup = build_service(role, units, sampler_modules, storage,
                                     curve_server_key=curve_server_key,
                                     owner_token=owner_token, unit_timeout=unit_timeout,
                                     checkpoint=checkpoint, owner=owner, spill_dir=spill_dir)
    bounds: ServerBounds = {"workers": WORKERS[role], "backlog": 1024,
                            "owner_token": owner_token,
                            "max_message": max_message or MAX_MESSAGE[role],
                            "wait_caps": WAIT_CAPS.get(role)}
    try:
        servers = [rpc_server(service, address, curve_secret_key=curve_secret_key,
                              allow_insecure=allow_insecure, **bounds)]
    except BaseException:
        cleanup()  # e.g. an address that cannot be bound: the unit's memory goes too
        raise
    local = None
    if local_dir is not None and curve_secret_key is None:
        try:
            servers.append(rpc_server(service, f"unix://{local_dir}/{role}", **bounds))
        except BaseException:
            cleanup()
            servers[0].close(timeout=STOP_GRACE)
            raise
        local = servers[1].address
        if role == "controller":
            service.local_address = local  # a controller tells same-host clients (ping)

    def stop() -> None:
        # The service first: a closed controller answers its waiting long-polls at once
        # (ClosedError), so the server's short grace is enough for running handlers.
        cleanup()
        for server in servers:
            server.close(timeout=STOP_GRACE)
        for server in servers:
            _remove_folder_if_empty(server.address)

    return servers[0], stop, local


def _remove_folder_if_empty(address: str) -> None:
    """The last server of a deployment to stop removes the folder of its unix sockets
    (its owner does too when it closes, but an owner that was killed cannot)."""
    for scheme in ("unix://", "ipc://"):
        if address.startswith(scheme):
            with contextlib.suppress(OSError):  # not empty (others still serve), or gone
                os.rmdir(os.path.dirname(address[len(scheme):]))


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    """Python half of the SIGTERM/SIGINT handler: nothing. The C half has already
    written the wakeup byte ``_wait_for_stop`` polls; installing a handler at all
    keeps the default action (death without cleanup) away."""


def _stop_signals() -> int:
    """Route SIGTERM/SIGINT to a pipe; returns its read end (main thread only)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_stop_signal)
    return read_end


def _wait_for_stop(wakeup_fd: int, parent_fd: int) -> None:
    """Return once a stop signal arrived or the parent's lifeline closed (EOF)."""
    poller = select.poll()
    poller.register(wakeup_fd, select.POLLIN)
    if parent_fd >= 0:
        poller.register(parent_fd, select.POLLIN)
    while True:
        for fd, _ in poller.poll(3600_000):  # ms; a timeout only re-enters the wait
            if fd == wakeup_fd:
                return
            try:
                if not os.read(parent_fd, 1):  # EOF: no process holds the write end
                    return
            except OSError:
                return


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the pipe watch still applies


def run_child(cfg: dict[str, Any], out: TextIO) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death; announce the address on ``out``."""
    wakeup_fd = _stop_signals()
    _die_with_parent()  # after the handlers: an early parent-death signal is not lost
    server, stop, _ = serve(
        cfg["role"], cfg.get("address", "tcp://127.0.0.1:0"), cfg.get("units", 1),
        tuple(cfg.get("sampler_modules", ())), cfg.get("storage", "shm"),
        (cfg.get("curve_secret") or "").encode() or None,
        (cfg.get("curve_server") or "").encode() or None,
        owner_token=cfg.get("owner_token"), max_message=cfg.get("max_message"),
        unit_timeout=cfg.get("unit_timeout"),
        checkpoint=(cfg.get("checkpoint_path"), cfg.get("checkpoint_interval")),
        owner=cfg.get("owner"), spill_dir=cfg.get("spill_dir"))
    try:
        from tq_stream import hosts

        out.write(json.dumps({"address": server.address, "pid": os.getpid(),
                              "host": hosts.host_id()}) + "\n")
        out.flush()
        _wait_for_stop(wakeup_fd, cfg.get("parent_fd", -1))
    finally:
        # Bounded: a stop stuck on a dead peer must not keep this process (an orphan
        # once its owner is gone) alive; the caller exits right after.
        stopper = threading.Thread(target=stop, daemon=True, name="tq-stop")
        stopper.start()
        stopper.join(EXIT_GRACE)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of a spawned child; settings arrive as one JSON line on stdin (keys
    stay out of the process table)."""
    argparse.ArgumentParser(prog="tq_stream.deploy.server").parse_args(argv)
    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) shows every thread
    code = run_child(json.loads(sys.stdin.readline()), sys.stdout)
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: a zmq context left by a peer cannot block it


if __name__ == "__main__":
    sys.exit(main())
