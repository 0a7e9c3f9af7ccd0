"""Taking a Ray deployment's lost actors back (``RayDeployment``'s ``restart_units`` and
``restart_controller``).

The driver drives it: the RayDeployment that started the actors re-creates them, from a
watch thread (``RayWatch``) or when asked (``restart_unit``, ``restart_controller``).
Actors are started with ``max_restarts=0``: Ray would restart an actor on the node it
was pinned to, which is no help when that node is gone, and would not tell the
controller about the new address; re-creating covers a dead process and a dead node
the same way.

- *A storage unit* whose actor died (Ray reports it dead), or that the controller
  declared lost (missed heartbeats) while its actor does not answer either, is
  re-created under the same name and unit index: on its node if Ray lists that node
  alive and Ray reported the actor dead (its process died), else (its node left, or
  Ray has not noticed yet) on the alive node holding the fewest units, another than
  its own when there is one. An attempt on a node that turns out gone fails; the next
  look tries again. It serves at a new
  address; the controller drops the old unit's rows (``unit_lost``), then calls the new
  one there (``drop_unit`` with its address record) and places rows on it again.
  Clients learn of the move from the ``units_epoch`` of the replies that place or hand
  out rows (``RemoteController``).
- *The controller* runs on the driver's node (with a checkpoint: where its
  checkpoint file is) and is re-created there at the same zmq address and unix socket,
  so clients reconnect by themselves, as in local mode; the new actor loads the last
  checkpoint before serving, then the driver attaches the units and the controller
  reconciles with what they hold (``deploy.meta_checkpoint``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tq_stream.deploy.ray_actor import ACTOR_OPTIONS, RayService
from tq_stream.errors import WaitTimeout, format_seconds

if TYPE_CHECKING:
    from ray.actor import ActorClass, ActorHandle

logger = logging.getLogger(__name__)

WATCH_INTERVAL = 0.5  # seconds between two looks at the actors
PROBE_TIMEOUT = 5.0  # seconds an actor may take to answer a look (a hung one is unknown)
NAME_TIMEOUT = 30.0  # seconds a dead actor's name may take to be released


def alive_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]


def probe(actors: Sequence[Any], timeout: float = PROBE_TIMEOUT) -> tuple[set[int], set[int]]:
    """Ask every actor for its info. Returns (indexes Ray reports dead, indexes that
    answered); the rest did not answer within ``timeout`` (hung, or a node Ray has not
    declared dead yet)."""
    import ray

    refs = [a.info.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    done = set(ready)
    dead, answered = set(), set()
    for i, ref in enumerate(refs):
        if ref not in done:
            continue
        try:
            ray.get(ref, timeout=0)
            answered.add(i)
        except ray.exceptions.ActorUnavailableError:
            pass  # unreachable for now: may come back
        except ray.exceptions.RayActorError:
            dead.add(i)
    return dead, answered


def unit_node(old: str, unit_nodes: Sequence[str], elsewhere: bool = False) -> str:
    """The node to re-create a unit on: its own if alive (and not ``elsewhere``), else
    the alive node holding the fewest units."""
    alive = alive_nodes()
    if elsewhere and len(alive) > 1:
        alive = [n for n in alive if n != old]
    if old in alive or not alive:
        return old
    held = Counter(unit_nodes)
    return min(alive, key=lambda n: held[n])


def create(actor_class: ActorClass[RayService], name: str, namespace: str, node: str,
           args: tuple[Any, ...], kwargs: dict[str, Any]) -> ActorHandle[RayService]:
    """Start an actor named ``name`` on ``node`` (a hard affinity: Ray's soft one places
    actors elsewhere even when the node is free); waits (``NAME_TIMEOUT``) for a dead
    actor of that name to release it. On a node that turns out gone the actor dies and
    the next look tries again on another."""
    from ray.actor import ActorHandle
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    deadline = time.monotonic() + NAME_TIMEOUT
    while True:
        try:
            actor = actor_class.options(
                **ACTOR_OPTIONS, name=name, namespace=namespace,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(*args, **kwargs)
            assert isinstance(actor, ActorHandle)  # Ray types it as a handle or the class
            return actor
        except ValueError:  # the name is still taken by the dead actor
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def started(actor: ActorHandle[Any], what: str, timeout: float) -> dict[str, Any]:
    """The new ``actor``'s info once it serves; killed and WaitTimeout after ``timeout``."""
    import ray

    try:
        info: dict[str, Any] = ray.get(actor.info.remote(), timeout=timeout)
        return info
    except BaseException as exc:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise WaitTimeout(f"a re-created {what} must serve within "
                              f"{format_seconds(timeout)}; it did "
                              "not (it was killed)") from None
        raise


def kill(actor: ActorHandle[Any]) -> None:
    import ray

    with contextlib.suppress(Exception):  # a dead actor is already gone
        ray.kill(actor, no_restart=True)


class Watched(Protocol):
    """What ``RayWatch`` needs of the deployment it watches (``RayDeployment``)."""

    def actors(self) -> list[Any]:
        """The actors: the units in index order, then the controller."""
        ...

    def dead_units(self) -> list[int]:
        """The units the controller declared lost."""
        ...

    def restart_unit(self, i: int, timeout: float | None = None,
                     elsewhere: bool = False) -> dict[str, int]: ...

    def restart_controller(self, timeout: float | None = None) -> dict[str, Any]: ...


class RayWatch:
    """Looks at a RayDeployment's actors every ``WATCH_INTERVAL`` seconds from a daemon
    thread and re-creates the dead ones (see the module docstring).

    Args:
        deployment: the actors' owner, which re-creates them.
        units: re-create dead storage units.
        controller: re-create a dead controller from its checkpoint.
    """

    def __init__(self, deployment: Watched, units: bool, controller: bool) -> None:
        self._deployment = deployment
        self._units = units
        self._controller = controller
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tq-ray-restart")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            try:
                self._look()
            except Exception as exc:  # noqa: BLE001 — closing, or Ray is busy: next round
                if not self._stop.is_set():
                    logger.warning("watching the tq_stream actors failed: %s", exc)

    def _look(self) -> None:
        d = self._deployment
        actors = d.actors()
        if not actors:
            return
        dead, answered = probe(actors)
        n = len(actors) - 1
        if self._controller and n in dead and not self._stop.is_set():
            try:
                d.restart_controller()
            except Exception as exc:  # noqa: BLE001 — the start failed: try again
                logger.warning("restarting the controller actor failed: %s", exc)
                return
        if not self._units:
            return
        lost = {i for i in dead if i < n}  # Ray reports the actor dead
        # Lost per the controller, no word from Ray: its node may be gone unnoticed yet.
        silent: set[int] = set()
        with contextlib.suppress(Exception):  # a controller restarting: Ray's word only
            silent = set(d.dead_units()) - answered - lost
        for i in sorted(lost | silent):
            if self._stop.is_set():
                return
            try:
                dropped = d.restart_unit(i, elsewhere=i in silent)
                logger.warning("storage unit %d died and was re-created; rows lost: %s", i,
                               dropped or "(none)")
            except Exception as exc:  # noqa: BLE001 — the start failed: try again
                logger.warning("re-creating storage unit %d failed: %s", i, exc)

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
