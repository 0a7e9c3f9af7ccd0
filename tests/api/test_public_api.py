"""The public API: ``__all__`` is sorted and complete; importing loads neither ray nor zmq."""

from __future__ import annotations

import subprocess
import sys
import types

import tq_stream


def isort_key(name: str) -> tuple[int, str]:
    """The order ruff (RUF022) keeps ``__all__`` in: CONSTANTS, Classes, then the rest."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_all_is_sorted_and_matches_public_names():
    assert tq_stream.__all__ == sorted(tq_stream.__all__, key=isort_key)
    for name in tq_stream.__all__:  # public names load on first use
        getattr(tq_stream, name)
    public = {name for name, value in vars(tq_stream).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    public |= {"__version__", "errors", "samplers"}
    assert set(tq_stream.__all__) == public
    for name in tq_stream.__all__:
        assert hasattr(tq_stream, name), name


def test_samplers_all_is_sorted_and_exported():
    samplers = tq_stream.samplers
    assert samplers.__all__ == sorted(samplers.__all__, key=isort_key)
    assert all(hasattr(samplers, n) for n in samplers.__all__)


def test_import_loads_neither_ray_nor_zmq():
    code = ("import sys, tq_stream\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'zmq'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == ""
