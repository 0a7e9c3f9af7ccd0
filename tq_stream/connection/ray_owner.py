"""Whether a Ray deployment is gone for good, as a process connected to Ray sees it.

The actors of ``tq.init(mode="ray")`` belong to the process that called it (a driver,
or an actor as a framework's driver actor): Ray kills them when it dies, and only it
re-creates them (``restart_units``, ``restart_controller``). The controller runs on
that owner's node. So nothing will serve the deployment again once

- its controller actor is dead (Ray no longer knows it by name) and restart_controller
  is off, or
- the owner's node left the cluster (the owner died with it, and its controller).

``OwnerWatch`` asks here (besides watching an owner process on its own host by pid);
only a process that is connected to Ray itself can tell: a forked child (a DataLoader
worker) shares its parent's connection, which it must not use, so it never says gone.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_forked = False  # this process is a fork of the one that imported this module


def _after_fork() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork)


def record(name: str, namespace: str, restarts: bool) -> dict[str, Any]:
    """What a client needs to tell that the deployment ``name`` is gone (part of the
    owner record the controller's ``ping`` reports); called by its owner."""
    import ray

    return {"name": name, "namespace": namespace, "restarts": bool(restarts),
            "node": ray.get_runtime_context().get_node_id()}


def gone(deployment: dict[str, Any]) -> str | None:
    """Why nothing will serve the Ray deployment described by ``record`` again, or None
    while it may (or this process cannot ask Ray)."""
    ray = sys.modules.get("ray")
    if _forked or ray is None or not ray.is_initialized():
        return None
    name, namespace = str(deployment["name"]), str(deployment["namespace"])
    actor = f"{name}_controller"
    try:
        ray.get_actor(actor, namespace=namespace)
        return None
    except ValueError:  # no live actor of that name
        pass
    except Exception:  # noqa: BLE001 — Ray cannot answer now: no news
        return None
    where = f"Ray deployment {name!r} (namespace {namespace!r})"
    if not deployment.get("restarts"):
        return (f"the controller actor {actor!r} of the {where} is dead, and "
                f"restart_controller is off")
    try:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 — Ray cannot answer now: no news
        return None
    node = deployment.get("node")
    if node not in alive:
        return (f"the node {node} of the {where}'s owner (the process that called tq.init) "
                f"and controller left the Ray cluster")
    return None
