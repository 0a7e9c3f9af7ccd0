"""Starting, joining and stopping the local Ray instance the Ray-based systems share."""

from __future__ import annotations

import importlib.util
import os

# TransferQueue's controller and each SimpleStorage unit ask for num_cpus=1: three logical
# CPUs on a two-core machine, so the local instance advertises more than it has.
DEFAULT_NUM_CPUS = max(4, os.cpu_count() or 1)


def ray_available() -> tuple[bool, str]:
    if importlib.util.find_spec("ray") is None:
        return False, "ray is not installed (pip install -e '.[bench]')"
    return True, ""


def ensure_ray(num_cpus: int = DEFAULT_NUM_CPUS) -> bool:
    """Start a local Ray instance unless this process is connected to one.

    Returns:
        True when this call started Ray (the caller then owns ``ray.shutdown()``).
    """
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        address="local",  # a new instance, never another session's cluster on this host
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        configure_logging=True,
    )
    return True


def address() -> str:
    """GCS address of the connected cluster, for child processes to join."""
    import ray

    return ray.get_runtime_context().gcs_address


def connect(gcs_address: str) -> None:
    """Join an existing cluster from a child process (no-op when already connected)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=gcs_address, log_to_driver=False, logging_level="ERROR")


def shutdown(owned: bool) -> None:
    """``ray.shutdown()`` when ``owned``; Ray then stops every process it started."""
    if owned:
        import ray

        ray.shutdown()
