"""Run a Ray job script in a process of its own, the way a user's driver runs: the
script template gets ``root`` (this checkout) and ``path`` (the PYTHONPATH its workers
need) plus any other fields; its stdout lines come back, the last ones usually JSON."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_ray_job(template: str, tmp_path: pathlib.Path, *, timeout: float = 230,
                **fields: str) -> list[str]:
    """Write ``template`` formatted with ``root``, ``path`` and ``fields`` to
    ``tmp_path/job.py``, run it and return its stdout lines; a non-zero exit fails the
    test with the end of its stderr."""
    path = os.pathsep.join([str(ROOT)] + sys.path[1:])
    script = tmp_path / "job.py"
    script.write_text(template.format(root=str(ROOT), path=path, **fields))
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()

