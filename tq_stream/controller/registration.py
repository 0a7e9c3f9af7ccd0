"""Consumer tasks: declaring a partition's, registering one, and what its consumer says.

Plain functions over the ``Book`` (lock held). ``declare`` sets a partition's
capacity and, once, the tasks that consume it (rows every one of them is done with
are freed from then on). ``register`` declares a task on a
partition: every rank registers the same ``TaskConfig`` and sampler class; a task
restored from a checkpoint is adopted by its first registration after the
restore (``checkpoint.adopt``); a new task is offered every ready row, oldest
first. ``set_version`` records the consumer's policy version (before the task is
registered too: a resumed trainer), ``reading`` the step it reads now.
"""

from __future__ import annotations

import numpy as np

from tq_stream.controller.book import Book, Freed
from tq_stream.controller.checkpoint import adopt
from tq_stream.controller.task import TaskState
from tq_stream.controller.task_config import TaskConfig
from tq_stream.errors import ConfigError
from tq_stream.samplers.base import Sampler


def declare(book: Book, partition: str, capacity: int | None,
            declared: tuple[str, ...] | None, spills: bool = False) -> Freed:
    """``Controller.create_partition`` (arguments checked): returns the slots to free."""
    part = book.part(partition, create=True)
    if part.capacity != capacity and part.live and capacity is not None \
            and capacity < part.live:
        raise ConfigError(
            f"capacity must be >= the {part.live} rows partition {partition!r} "
            f"holds, got {capacity}"
        )
    if declared is not None and part.consumers not in (None, declared):
        raise ConfigError(
            f"consumers of partition {partition!r} are declared once: had "
            f"{list(part.consumers or ())}, got {list(declared)}")
    if declared is not None:
        stray = sorted(set(book.tasks[partition]) - set(declared))
        if stray:
            raise ConfigError(
                f"consumers must include every task already registered on partition "
                f"{partition!r}, missing {stray} from {list(declared)}")
    part.capacity = capacity
    part.spills = part.spills or spills is True
    if declared is not None and part.consumers is None:
        part.consumers = declared
        return book.finish_rows(part, np.flatnonzero(part.used))
    return []


def register(book: Book, partition: str, task: str, config: TaskConfig,
             sampler: Sampler) -> None:
    """Declare consumer ``task`` of ``partition`` (made if new); ConfigError if it is
    not a declared consumer, or another rank registered it otherwise."""
    part = book.part(partition, create=True)
    if part.consumers is not None and task not in part.consumers:
        raise ConfigError(
            f"task must be one of the declared consumers {list(part.consumers)} of "
            f"partition {partition!r}, got {task!r}")
    existing = book.tasks[partition].get(task)
    if existing is not None and existing.restored is not None:
        adopt(existing, config, sampler)
        book.cond.notify_all()
        return
    if existing is not None:
        if existing.config != config:
            raise ConfigError(
                f"task {task!r} on partition {partition!r} must be registered with the "
                f"same settings by every rank: had {existing.config}, got {config}"
            )
        if type(existing.sampler) is not type(sampler):
            raise ConfigError(
                f"sampler of task {task!r} must be the same class on every rank: had "
                f"{type(existing.sampler).__name__}, got {type(sampler).__name__}"
            )
        return
    state = TaskState(task, config, sampler, part.size)
    state.last_move = book.clock()
    state.version, state.version_step = part.versions.pop(task, (None, None))
    rows = part.oldest_first(np.flatnonzero(part.used))
    state.offer(rows, part.ready_for(config.fields, rows, state.tags))
    book.tasks[partition][task] = state
    book.cond.notify_all()


def set_version(book: Book, partition: str, task: str, version: int,
                at_step: int | None) -> None:
    """``Controller.set_version`` (arguments checked)."""
    part = book.part(partition, create=True)
    state = book.tasks[partition].get(task)
    if state is None:  # before the consumer registers (a resumed trainer)
        part.versions[task] = (version, at_step)
    else:
        state.set_version(version, at_step)
    book.cond.notify_all()


def reading(book: Book, partition: str, task: str, step: int) -> None:
    """``Controller.reading`` (``step`` checked)."""
    state = book.task(partition, task)[1]
    before = state.position
    state.reading(step)
    if state.position != before:
        state.last_move = book.clock()
        book.cond.notify_all()
