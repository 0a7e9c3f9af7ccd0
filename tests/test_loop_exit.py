"""loop_exit.left_by_jump: a break/return out of a for loop tells itself apart from an
exception unwinding it (issue 20 item 1: the loader acked the batch of a step that
raised, because both just close the generator)."""

from __future__ import annotations

import itertools
import sys

import pytest

from tq_stream.datasets.loop_exit import left_by_jump


def gen(log: list[bool]):
    try:
        yield from range(5)
    except GeneratorExit:
        log.append(left_by_jump(sys._getframe().f_back))
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


@pytest.mark.parametrize("how", [by_break, by_return, by_break_in_with, by_break_in_except,
                                 by_enumerate_break])
def test_a_jump_out_of_the_loop_is_a_jump(how):
    log: list[bool] = []
    how(log)
    assert log == [True]


@pytest.mark.parametrize("how", [by_raise, by_call_raise, by_finally_reraise, by_divide,
                                 by_islice, by_close])
def test_anything_else_is_not(how):
    log: list[bool] = []
    try:
        how(log)
    except (ValueError, ZeroDivisionError):
        pass
    assert log == [False]


def test_no_frame_is_not_a_jump():
    assert left_by_jump(None) is False
