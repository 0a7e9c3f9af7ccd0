"""How a for loop over a loader's generator ended: a jump (break, return) or not.

A generator closed by a ``break`` and one closed by an exception unwinding the loop
both just see GeneratorExit (``sys.exc_info()`` is empty in both). What differs is
the frame that dropped the iterator (``sys._getframe(1)`` in the GeneratorExit
handler): a ``break`` or ``return`` pops the for-iterator with ``POP_TOP``
(``POP_ITER`` from 3.14 on), while an exception leaves that frame at the
instruction that raised (``CALL``, ``RAISE_VARARGS``, ``RERAISE`` ...).
Checked on CPython 3.10-3.13 (``tests/datasets/test_loop_exit.py``). Everything else counts
as "not a jump": ``it.close()``, ``del it``, the end of a wrapping iterator
(``islice``, ``zip``: ``FOR_ITER``, or on 3.14 ``POP_ITER`` right after
``END_FOR``), a generator wrapping the loop (before 3.13), interpreter exit.
One more case counts as done: the generator dropped as the temporary of the very
``next(...)`` call that resumed it (``next(iter(loader))``). Known gap: one call
that pulls a batch and then raises, dropping the generator
(``list(zip(loader, failing))``), looks the same and counts as done.
"""

from __future__ import annotations

import dis
import inspect
from types import FrameType

_POPS = frozenset({"POP_TOP", "POP_ITER"})
_CALLS = frozenset({"CALL", "CALL_FUNCTION", "CALL_METHOD"})  # 3.11+, 3.10


def left_by_jump(frame: FrameType | None) -> bool:
    """Whether ``frame``, which just dropped a for loop's iterator, did so by a
    ``break``/``return`` (True) rather than an exception or anything else (False)."""
    if frame is None or frame.f_lasti < 0:
        return False
    code, lasti = frame.f_code, frame.f_lasti
    if lasti >= len(code.co_code) or dis.opname[code.co_code[lasti]] not in _POPS:
        return False
    before = None  # 3.14: the end of an outer iterator is END_FOR, then POP_ITER
    for ins in dis.get_instructions(code):
        if ins.offset >= lasti:
            break
        before = ins.opname
    return before != "END_FOR"


def _caller_of_caller() -> FrameType | None:
    here = inspect.currentframe()
    try:
        me = here.f_back if here else None  # the public function below
        gen = me.f_back if me else None  # the generator that called it
        return gen.f_back if gen else None  # who runs (or closes) that generator
    finally:
        del here


def resumed_at() -> tuple[int, int] | None:
    """Where the generator calling this was resumed from: (id of the frame, its
    instruction offset). Give it to ``closed_by_jump`` at the close."""
    frame = _caller_of_caller()
    return None if frame is None else (id(frame), frame.f_lasti)


_UNKNOWN = frozenset({"FOR_ITER", "END_FOR", "POP_ITER", "DELETE_FAST", "DELETE_NAME",
                      "DELETE_GLOBAL", "STORE_FAST", "STORE_NAME", "STORE_GLOBAL"})


def verdict(resumed: tuple[int, int] | None = None) -> bool | None:
    """Called in a generator's GeneratorExit handler: True if the loop was left by a
    jump (``closed_by_jump``), None if nothing says how (a wrapping iterator such as
    ``islice`` that ended: ``FOR_ITER``/``END_FOR``; the iterator deleted or
    rebound; no caller frame), False otherwise (an exception unwinding the loop, or
    an explicit ``close()``)."""
    frame = _caller_of_caller()
    if frame is None or frame.f_lasti < 0 or frame.f_lasti >= len(frame.f_code.co_code):
        return None
    if _jumped(frame, resumed):
        return True
    return None if dis.opname[frame.f_code.co_code[frame.f_lasti]] in _UNKNOWN else False


def closed_by_jump(resumed: tuple[int, int] | None = None) -> bool:
    """Called in a generator's GeneratorExit handler: whether the frame that closed it
    left a for loop by a jump (``left_by_jump``), or dropped it as the temporary of
    the very ``next(...)`` call that resumed it last (``next(iter(loader))``, a CALL
    at the offset ``resumed_at`` recorded: no exception can have come in between).
    Holds no frame afterwards (a generator frame kept in its own locals would outlive
    the loop, and with it whatever the generator holds)."""
    frame = _caller_of_caller()
    return frame is not None and _jumped(frame, resumed)


def _jumped(frame: FrameType, resumed: tuple[int, int] | None) -> bool:
    if resumed == (id(frame), frame.f_lasti) and \
            dis.opname[frame.f_code.co_code[frame.f_lasti]] in _CALLS:
        return True
    return left_by_jump(frame)
