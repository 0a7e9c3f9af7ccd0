"""The backend contract on MemoryUnit (other backends join through ``UNITS``)."""

from __future__ import annotations

import pytest

from tests.helpers.backend_contract import BackendContract
from tq_stream.backends.memory import MemoryUnit

UNITS = {"memory": MemoryUnit}


@pytest.fixture(params=sorted(UNITS))
def unit(request):
    u = UNITS[request.param]()
    try:
        yield u
    finally:
        u.close()


class TestBackend(BackendContract):
    pass
