"""How a for loop over a loader's generator ended: a jump (break, return) or not.

A generator closed by a ``break`` and one closed by an exception unwinding the loop
both just see GeneratorExit (``sys.exc_info()`` is empty in both). What differs is
the frame that dropped the iterator (``sys._getframe(1)`` in the GeneratorExit
handler): a ``break``, ``return`` or ``continue``-out-of-loop pops the for-iterator
with ``POP_TOP`` (``POP_ITER`` from 3.14 on), while an exception leaves that frame
at the instruction that raised (``CALL``, ``RAISE_VARARGS``, ``RERAISE`` ...).
Checked on CPython 3.10-3.13 (``tests/test_loop_exit.py``). Everything else counts
as "not a jump": ``it.close()``, ``del it``, the end of a wrapping iterator
(``islice``, ``zip``: ``FOR_ITER``, or on 3.14 ``POP_ITER`` right after
``END_FOR``), a generator wrapping the loop (before 3.13), interpreter exit.
"""

from __future__ import annotations

import dis
import inspect
from types import FrameType

_POPS = frozenset({"POP_TOP", "POP_ITER"})


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


def closed_by_jump() -> bool:
    """``left_by_jump`` of the frame that closed the generator calling this (from its
    GeneratorExit handler). Holds no frame afterwards: a generator frame kept in its
    own locals would outlive the loop, and with it whatever the generator holds."""
    here = inspect.currentframe()
    try:
        gen = here.f_back if here else None
        return left_by_jump(gen.f_back if gen else None)
    finally:
        del here
