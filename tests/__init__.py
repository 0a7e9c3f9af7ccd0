"""tq_stream's tests, in folders that mirror the package.

- ``tests/<folder>/``: unit tests (embedded mode, no sockets or processes) of
  ``tq_stream/<folder>/``; ``api/`` is the client layer's top-level modules (stream,
  writer, client, kv, meta, the package itself) and ``wire/`` the data formats (columns,
  convert, serialization, framefile, buffers, multi-ragged fields).
- ``tests/integration/<folder>/``: the same folders with sockets, processes or Ray
  (``pytestmark = pytest.mark.integration``); ``integration/faults/`` kills processes.
- ``tests/helpers/``: shared cases, contract suites, fixtures and worker functions,
  imported as ``from tests.helpers.<name> import ...``. ``tests/conftest.py`` holds the
  embedded fixtures and the small data builders (``from tests.conftest import keys_of``).

Every folder is a package, so pytest puts the checkout on ``sys.path`` and a spawned or
Ray worker finds ``tests.helpers.<name>`` from there; keep basenames unique anyway.
"""
