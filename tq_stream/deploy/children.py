"""Child server processes of a ``LocalDeployment``: how one is started and awaited.

A child is started by fork (fast: modules are already imported) or by running
``python -m tq_stream.deploy.server`` ("spawn", settings on stdin). Each child watches a
pipe whose write end only this process holds (its lifeline), so it exits when this
process exits, even by SIGKILL. ``await_ready`` reads each child's first line: the
address it serves on.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from tq_stream.errors import StateError, WaitTimeout, format_seconds

_LIFELINES: set[int] = set()  # write ends held by this process; a forked child closes them


class Child:
    """One server process, started by fork (fast: modules are already imported) or by
    running a fresh interpreter ("spawn"). Either way its settings never appear in the
    process table and it exits when its lifeline pipe closes."""

    def __init__(self, settings: dict[str, Any], start_method: str) -> None:
        self.settings = settings
        read_end, self.lifeline = os.pipe()
        _LIFELINES.add(self.lifeline)
        settings = {**settings, "parent_fd": read_end}
        if start_method == "fork":
            self._fork(settings, read_end)
        else:
            self._spawn(settings, read_end)
        os.close(read_end)
        self.info: dict[str, Any] | None = None

    def _spawn(self, settings: dict[str, Any], read_end: int) -> None:
        self.proc: Any = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "tq_stream.deploy.server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(read_end,), close_fds=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(settings) + "\n").encode())
        self.proc.stdin.close()
        assert self.proc.stdout is not None
        self.stdout: IO[bytes] = self.proc.stdout

    def _fork(self, settings: dict[str, Any], read_end: int) -> None:
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(ready_r)
                for fd in _LIFELINES:
                    os.close(fd)
                from tq_stream.deploy.server import run_child

                code = run_child(settings, os.fdopen(ready_w, "w"))
            finally:
                os._exit(code)
        os.close(ready_w)
        self.proc = ForkedProcess(pid)
        self.stdout = os.fdopen(ready_r, "rb")

    @property
    def served(self) -> dict[str, Any]:
        """What the child announced once it served (``address``, ``pid``, ``host``).

        Raises:
            StateError: it has not announced it yet (``await_ready`` has not returned).
        """
        if self.info is None:
            raise StateError(f"a tq_stream server (pid {self.pid}) must have announced its "
                             "address (await_ready) before it is used, got no announcement")
        return self.info

    @property
    def pid(self) -> int:
        pid: int = self.proc.pid
        return pid

    def forget(self) -> None:
        """Close this side's pipes to the child (after it exited), once: a restart whose
        start failed forgets it again, when its fd may be another socket's."""
        if self.lifeline < 0:
            return
        os.close(self.lifeline)
        _LIFELINES.discard(self.lifeline)
        self.lifeline = -1
        self.stdout.close()


class ForkedProcess:
    """The subset of Popen that close() uses, for a child made by os.fork."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Wait for the exit, woken by the kernel (a pidfd becomes readable when the
        process ends); raises TimeoutExpired after ``timeout`` seconds."""
        if self.poll() is not None:
            assert self.returncode is not None
            return self.returncode
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            fd = -1  # already gone: reap below
        if fd >= 0:
            try:
                select.select([fd], [], [], timeout)
            finally:
                os.close(fd)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        try:
            if self.poll() is None:  # once reaped, its pid may be another process's
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def await_ready(children: Sequence[Child], timeout: float) -> None:
    sel = selectors.DefaultSelector()
    for c in children:
        sel.register(c.stdout, selectors.EVENT_READ, c)
    deadline = time.monotonic() + timeout
    waiting = len(children)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"tq_stream servers did not start within {format_seconds(timeout)}")
        for key, _ in sel.select(timeout=left):
            child: Child = key.data
            line = key.fileobj.readline()  # type: ignore[union-attr]
            sel.unregister(key.fileobj)
            if not line:
                raise StateError(f"a tq_stream server (pid {child.pid}) exited during start "
                                 f"with code {child.proc.wait(timeout=5)}")
            child.info = json.loads(line)
            waiting -= 1
    sel.close()
