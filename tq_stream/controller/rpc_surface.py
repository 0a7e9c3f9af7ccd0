"""The controller's RPC surface: the methods a server may call, which of them run on
its IO thread, which may wait (and by whom), and which take their request's reply
handle. A new controller RPC is a public ``Controller`` method plus its name here
(and, if it may wait or must not block the IO thread, in ``WAITS`` / out of
``INLINE``); ``transport/dispatch.py`` checks the tables when a server starts."""

from __future__ import annotations

METHODS = frozenset({
    "create_partition", "close_partition", "reserve", "commit", "abort", "register_task",
    "get_meta", "ack", "release", "renew", "clear", "lookup", "locate", "list_rows",
    "list_tags", "keys_of", "set_tags", "set_version", "reading", "stats", "partitions",
    "admit", "set_admission", "admission", "commit_new", "release_spares",
    "first_unfinished", "cancel", "task_rows", "dead_units", "reserve_shared",
    "media_hold", "media_release", "media_lookup",
})
# Methods that never wait, so a server may run them on its IO thread: they hold the
# lock only for short CPU work; reserve and admit raise WouldBlock instead of waiting.
# Not here: get_meta (waits, and a sampler's discards free storage through the units),
# ack / clear / abort (free storage through the units), list_rows / register_task
# (work proportional to the partition, or a sampler module import).
INLINE = frozenset({
    "create_partition", "close_partition", "partitions", "reserve", "commit", "release",
    "renew", "lookup", "locate", "keys_of", "set_tags", "set_version", "reading", "stats",
    "admit", "set_admission", "admission", "commit_new", "release_spares",
    "first_unfinished", "cancel", "task_rows", "dead_units",
})
# Methods that may wait long, by who waits (a server caps each class: see
# ``tq_stream.transport.wait_slots``).
WAITS: dict[str, str] = {"get_meta": "consume", "reserve": "produce", "admit": "produce",
                         "reserve_shared": "produce"}
# Methods a server calls with their request's reply handle: a commit may answer a
# waiting get_meta (``waiters.py``).
REPLIES = frozenset({"get_meta"})
