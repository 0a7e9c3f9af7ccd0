"""How many rows a consumer task will still see (read-only, a function of metadata).

``len(loader)`` of a closed partition is the steps already formed plus the steps
the rows left can still form; ``Controller.task_rows`` (which holds the lock) is
the one controller call it needs.
"""

from __future__ import annotations

import numpy as np

from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import NEW, TaskState
from tq_stream.messages.reads import TaskRows


def task_rows(part: PartitionMeta | None, state: TaskState | None) -> TaskRows:
    """Rows a task (``state``, None: not registered) will still be handed in new steps of
    partition ``part`` (None: it does not exist), and the steps formed so far.

    Returns:
        ``TaskRows``: ``exists``  (the partition exists), ``closed`` (no new rows will
        come), ``remaining`` (live rows not yet in a step of the task nor
        discarded by it, ready or not), ``formed`` (steps formed, the end marker not
        counted) and ``ended`` (the task's end marker was formed). A task not yet
        registered has formed no step and will see every live row.
    """
    if part is None:
        return TaskRows(exists=False, closed=False, remaining=0, formed=0, ended=False)
    if state is None:
        return TaskRows(exists=True, closed=bool(part.closed),
                        remaining=int(part.live - part.shared.count), formed=0, ended=False)
    n = min(part.size, state.state.shape[0])
    new = int(np.count_nonzero(part.row_mask(n) & (state.state[:n] == NEW)))
    return TaskRows(exists=True, closed=bool(part.closed), remaining=new,
                    formed=state.next_step - (1 if state.ended else 0),
                    ended=bool(state.ended))


__all__ = ["task_rows"]
