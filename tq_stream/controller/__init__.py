"""The controller: metadata of partitions, rows, readiness, tasks and leases."""

from tq_stream.controller.controller import Controller

__all__ = ["Controller"]
