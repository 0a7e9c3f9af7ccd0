"""loop_exit.left_by_jump: a break/return out of a for loop tells itself apart from an
exception unwinding it (issue 20 item 1: the loader acked the batch of a step that
raised, because both just close the generator)."""

from __future__ import annotations

import itertools

import pytest

from tq_stream.datasets.loop_exit import closed_by_jump, left_by_jump, resumed_at


def gen(log: list[bool]):
    for i in range(5):
        resumed = resumed_at()
        try:
            yield i
        except GeneratorExit:
            log.append(closed_by_jump(resumed))
            raise


def by_break(log):
    for x in gen(log):
        if x == 1:
            break


def by_return(log):
    for x in gen(log):
        if x == 1:
            return x
    return None


def by_break_in_with(log):
    import contextlib
    for x in gen(log):
        with contextlib.nullcontext():
            if x == 1:
                break


def by_break_in_except(log):
    for _ in gen(log):
        try:
            raise ValueError
        except ValueError:
            break


def by_enumerate_break(log):
    for i, _ in enumerate(gen(log)):
        if i == 1:
            break


def by_next_of_a_temporary(log):
    first = next(iter(gen(log)))  # the iterator is dropped by that very call
    return first


def by_raise(log):
    for x in gen(log):
        if x == 1:
            raise ValueError


def by_call_raise(log):
    def step():
        raise ValueError
    for x in gen(log):
        if x == 1:
            step()


def by_finally_reraise(log):
    for x in gen(log):
        try:
            if x == 1:
                raise ValueError
        finally:
            pass


def by_divide(log):
    for x in gen(log):
        if x == 1:
            1 / 0  # noqa: B018


def by_islice(log):
    for _ in itertools.islice(gen(log), 2):
        pass


def by_close(log):
    it = gen(log)
    next(it)
    it.close()


def by_zip_stopping(log):
    for _ in zip(gen(log), range(1), strict=False):  # zip drops the loader's second item unseen
        pass


def by_list_of_a_failing_zip(log):
    def failing():
        yield 0
        raise ValueError
    list(zip(gen(log), failing(), strict=False))


@pytest.mark.parametrize("how", [by_break, by_return, by_break_in_with, by_break_in_except,
                                 by_enumerate_break, by_next_of_a_temporary])
def test_a_jump_out_of_the_loop_is_a_jump(how):
    log: list[bool] = []
    how(log)
    assert log == [True]


@pytest.mark.parametrize("how", [by_raise, by_call_raise, by_finally_reraise, by_divide,
                                 by_islice, by_close, by_zip_stopping])
def test_anything_else_is_not(how):
    log: list[bool] = []
    try:
        how(log)
    except (ValueError, ZeroDivisionError):
        pass
    assert log == [False]


def test_no_frame_is_not_a_jump():
    assert left_by_jump(None) is False
