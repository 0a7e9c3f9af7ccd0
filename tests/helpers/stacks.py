"""Every thread's stack, printed when a call times out: a hang seen only in the full
suite is then diagnosed from the CI log instead of replayed."""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from collections.abc import Iterator


def all_stacks() -> str:
    """The current stack of every thread of this process, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


@contextlib.contextmanager
def stacks_on(*errors: type[BaseException]) -> Iterator[None]:
    """Print every thread's stack to stderr if one of ``errors`` escapes the block."""
    try:
        yield
    except errors:
        print(all_stacks(), file=sys.stderr)
        raise
