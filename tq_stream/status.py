"""``tq-stream status ADDRESS``: what a running deployment is doing, as tables.

Connects with ``tq.connect(address)`` and makes read-only calls only
(``stats``, ``deployment_stats``, ``processes``): it never registers a task, writes,
leases or acks, so watching does not disturb the stream. ``--watch`` redraws in
place every ``--interval`` seconds until Ctrl-C.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tq_stream.errors import TQError, check_timeout
from tq_stream.stats import DeploymentStats, PartitionStats, describe

if TYPE_CHECKING:
    from tq_stream.stream import Stream

PIPE_WIDTH = 160  # columns of the tables when the output is not a terminal
DEFAULT_STATUS_TIMEOUT = 10.0  # seconds a call of ``tq-stream status`` waits for a reply


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def task_table(stats: dict[str, PartitionStats]) -> Table:
    table = Table(title="Tasks", title_justify="left")
    for col in ("partition", "task", "ready", "leased", "acked", "discarded",
                "out/s", "acked/s", "lag s", "step", "not ready"):
        table.add_column(col, justify="left" if col in ("partition", "task", "not ready")
                         else "right")
    for pname, p in sorted(stats.items()):
        for tname, t in sorted(p["tasks"].items()):
            discarded = sum(t["discarded"].values())
            table.add_row(pname, tname, str(t["available"]), str(t["leased"]), str(t["acked"]),
                          str(discarded), f"{t['rates']['handed_out']:.1f}",
                          f"{t['rates']['acked']:.1f}", f"{t['oldest_ready_age']:.1f}",
                          "end" if t["ended"] else str(t["next_step"]),
                          describe(t["not_ready"]) or "-")
    return table


def lease_table(stats: dict[str, PartitionStats]) -> Table:
    """Who holds each task's shares: a dead holder's heartbeat age grows, a slow one's
    does not; a lease past its expiry reads "expired" (its share goes to the next
    reader of that step and rank)."""
    table = Table(title="Leases", title_justify="left")
    for col in ("partition", "task", "step", "rank", "replica", "rows", "holder", "age s",
                "heartbeat s", "expires s"):
        table.add_column(col, justify="left" if col in ("partition", "task", "holder")
                         else "right")
    for pname, p in sorted(stats.items()):
        for tname, t in sorted(p["tasks"].items()):
            for lease in t["leases"]:
                holder = lease["consumer"] or lease["session"][:12]
                table.add_row(pname, tname, str(lease["step"]), str(lease["dp_rank"]),
                              str(lease["replica"]), str(lease["rows"]), holder,
                              _seconds(lease["age"]), _seconds(lease["heartbeat_age"]),
                              f"{lease['expires_in']:.1f}" if lease["expires_in"] > 0
                              else "expired")
    return table


def _seconds(s: float | None) -> str:
    return "?" if s is None else f"{s:.1f}"


def partition_table(stats: dict[str, PartitionStats]) -> Table:
    table = Table(title="Partitions", title_justify="left")
    for col in ("partition", "rows", "capacity", "created", "state", "blocked s"):
        table.add_column(col, justify="left" if col in ("partition", "state") else "right")
    for name, p in sorted(stats.items()):
        waits = p["blocked_seconds"]
        blocked = waits["capacity"] + waits["admission"] + waits["memory_budget"]
        table.add_row(name, str(p["rows"]), "-" if p["capacity"] is None else str(p["capacity"]),
                      str(p["rows_created"]), "closed" if p["closed"] else "open",
                      f"{blocked:.1f}")
    return table


def unit_table(servers: DeploymentStats) -> Table:
    table = Table(title="Storage units", title_justify="left")
    for col in ("unit", "health", "pid", "bytes", "spilled", "rows", "rpc calls",
                "rpc errors"):
        table.add_column(col, justify="left" if col in ("unit", "health") else "right")
    for u in servers["units"]:
        if not u["up"]:
            table.add_row(str(u["unit"]), Text("down", style="bold red"), "-", "-", "-", "-",
                          "-", "-")
            continue
        rows = sum(p["rows"] for p in u["partitions"].values())
        spilled = sum(p.get("spilled", 0) for p in u["partitions"].values())
        calls = sum(u["rpc"]["calls"].values())
        errors = sum(n for kinds in u["rpc"]["errors"].values() for n in kinds.values())
        table.add_row(str(u["unit"]), Text("up", style="green"), str(u["pid"]),
                      _bytes(u["nbytes"]), _bytes(spilled), str(rows), str(calls),
                      str(errors))
    return table


def render(stream: Stream) -> Group:
    """The status of ``stream``'s deployment as rich renderables (read-only calls)."""
    stats = stream.stats()
    servers = stream.deployment_stats()
    down = len([u for u in servers["units"] if not u["up"]])
    head = Text.assemble(
        ("tq_stream ", "bold"), f"{stream.address or 'embedded'}  ",
        f"controller pid {servers['controller']['pid']}  ",
        f"{len(servers['units'])} units", (f" ({down} down)" if down else "", "bold red"),
        f"  {time.strftime('%H:%M:%S')}")
    return Group(head, partition_table(stats), task_table(stats), lease_table(stats),
                 unit_table(servers))


def main(address: str, watch: bool = False, interval: float = 2.0,
         console: Console | None = None, curve_server_key: bytes | None = None,
         timeout: float = DEFAULT_STATUS_TIMEOUT) -> int:
    """Print the status of the deployment at ``address`` once, or redraw it in place
    every ``interval`` seconds with ``watch`` (until Ctrl-C). Returns the exit code:
    0, or 1 when the deployment cannot be reached (one line on stderr says why:
    gone, no reply within ``timeout``, a wrong address or key).

    Args:
        curve_server_key: the deployment's CURVE public key, when it requires CURVE.
        timeout: seconds each call to the deployment waits for its reply.
    """
    # Not a terminal (a pipe, a log): rich would cut the tables to 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)
    try:
        return _show(address, watch, interval, console, curve_server_key,
                     check_timeout("timeout", timeout))
    except TQError as exc:
        Console(stderr=True).print(f"tq-stream status: {exc}", markup=False,
                                   highlight=False)
        return 1


def _show(address: str, watch: bool, interval: float, console: Console,
          curve_server_key: bytes | None, timeout: float) -> int:
    import tq_stream as tq

    stream = tq.connect(address, config=tq.StreamConfig(timeout=timeout),
                        curve_server_key=curve_server_key)
    try:
        if not watch:
            console.print(render(stream))
            return 0
        with Live(render(stream), console=console, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(max(0.1, interval))
                    live.update(render(stream), refresh=True)
            except KeyboardInterrupt:
                return 0
    finally:
        stream.close()
