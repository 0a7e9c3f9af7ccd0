"""Packaging: the wheel installs only ``tq_stream``; one version; the CLI's ``--version``
and the benchmark harness found from the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tq_stream as tq
from tq_stream import cli
from tq_stream._version import __version__

ROOT = Path(__file__).resolve().parent.parent.parent


def test_version_has_one_source() -> None:
    assert tq.__version__ == __version__
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text
    assert "tq_stream._version.__version__" in text


def test_cli_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"tq-stream {__version__}"


def test_bench_harness_is_found_next_to_the_package() -> None:
    harness = cli.bench_harness()
    assert Path(harness.__file__).resolve() == ROOT / "benchmarks" / "__main__.py"
    assert callable(harness.main)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_installs_no_top_level_benchmarks(tmp_path: Path) -> None:
    # build isolation: pip fetches the setuptools pyproject asks for (>= 77, for the
    # SPDX license string), whatever this environment has
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("tq_stream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"tq_stream", f"tq_stream-{__version__}.dist-info"}
    assert "tq_stream/py.typed" in names
    assert f"tq_stream-{__version__}.dist-info/licenses/LICENSE" in names
    meta = zipfile.ZipFile(wheel).read(f"tq_stream-{__version__}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta


def test_both_controllers_provide_what_the_client_layers_call() -> None:
    from tq_stream.connection.protocols import ControllerAPI
    from tq_stream.connection.proxies import RemoteController
    from tq_stream.controller import Controller

    assert isinstance(Controller(), ControllerAPI)
    assert isinstance(RemoteController(rpc=None, timeout=1.0), ControllerAPI)
