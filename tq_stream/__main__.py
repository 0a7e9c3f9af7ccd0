"""``python -m tq_stream``: the ``tq-stream`` command."""

import sys

from tq_stream.cli import main

sys.exit(main())
