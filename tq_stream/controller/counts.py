"""CountLogic: how many rows a consumer task will still see (read-only).

``len(loader)`` of a closed partition is the steps already formed plus the steps
the rows left can still form; this is the one controller call it needs. Called by
the Controller's public methods; ``self`` is the Controller, whose lock it takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tq_stream.controller.task import NEW


class CountLogic:
    """Mixin of Controller; see the module docstring."""

    def task_rows(self, partition: str, task: str) -> dict[str, Any]:
        """Rows ``task`` will still be handed in new steps, and the steps formed so far.

        Returns:
            dict of ``exists`` (the partition exists), ``closed`` (no new rows will
            come), ``remaining`` (live rows not yet in a step of the task nor
            discarded by it, ready or not), ``formed`` (steps formed, the end marker not
            counted) and ``ended`` (the task's end marker was formed). A task not yet
            registered has formed no step and will see every live row.
        """
        with self._cond:  # type: ignore[attr-defined]
            self._check_open()  # type: ignore[attr-defined]
            part = self._parts.get(partition)  # type: ignore[attr-defined]
            if part is None:
                return {"exists": False, "closed": False, "remaining": 0, "formed": 0,
                        "ended": False}
            state = self._tasks[partition].get(task)  # type: ignore[attr-defined]
            if state is None:
                return {"exists": True, "closed": bool(part.closed),
                        "remaining": int(part.live), "formed": 0, "ended": False}
            n = min(part.size, state.state.shape[0])
            new = int(np.count_nonzero(part.used[:n] & (state.state[:n] == NEW)))
            return {
                "exists": True, "closed": bool(part.closed), "remaining": new,
                "formed": state.next_step - (1 if state.ended else 0),
                "ended": bool(state.ended),
            }
