"""The ``tq-stream`` command: ``demo``, ``status`` and ``bench``."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from tq_stream._version import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tq-stream", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tq-stream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded streaming demo")
    demo.add_argument("--prompts", type=int, default=512)
    demo.add_argument("--group-size", type=int, default=8)
    status = sub.add_parser("status", help="show what a running deployment is doing")
    status.add_argument("address", help="the controller's address (stream.address)")
    status.add_argument("--watch", action="store_true", help="redraw in place until Ctrl-C")
    status.add_argument("--once", action="store_true",
                        help="print the tables once and exit (the default)")
    status.add_argument("--interval", type=float, default=2.0,
                        help="seconds between redraws with --watch")
    status.add_argument("--curve-key", default=None,
                        help="the deployment's CURVE public key (stream.curve_server_key, "
                             "z85 text) when it requires CURVE")
    status.add_argument("--timeout", type=float, default=10.0,
                        help="seconds each call waits for the deployment's reply (default 10)")
    bench = sub.add_parser("bench", help="run the benchmarks side by side (from a checkout)")
    bench.add_argument("--quick", action="store_true", help="small shapes, seconds, no peers")
    bench.add_argument("--systems", default="", help="comma-separated subset of systems")
    bench.add_argument("--out", default="benchmarks/RESULTS.md")
    bench.add_argument("--workloads", default="",
                       help="comma-separated subset of bulk,small,streaming,controller,verl,"
                            "nemo_rl")
    return parser


def bench_harness() -> ModuleType:
    """The ``benchmarks`` package of the source checkout this package runs from.

    The harness is not installed with the wheel (a top-level ``benchmarks`` package
    would shadow others), so it is imported from the checkout next to ``tq_stream/``
    (an editable install or a run from the repository).

    Raises:
        ImportError: no checkout holds the harness.
    """
    root = Path(__file__).resolve().parent.parent
    if (root / "benchmarks" / "__main__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module("benchmarks.__main__")
    except ImportError as exc:
        raise ImportError(
            f"tq-stream bench must run from a source checkout of tq_stream (git clone, then "
            f"pip install -e '.[bench]'); no benchmarks/ next to {Path(__file__).parent}: {exc}"
        ) from exc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from tq_stream.demo import DemoConfig, run

        summary = run(DemoConfig(prompts=args.prompts, group_size=args.group_size))
        ok = summary["duplicates"] == 0 and summary["missing"] == 0
        return 0 if ok else 1
    if args.command == "status":
        from tq_stream.status import main as status_main

        key = None if args.curve_key is None else args.curve_key.encode()
        return status_main(args.address, watch=args.watch and not args.once,
                           interval=args.interval, curve_server_key=key,
                           timeout=args.timeout)
    try:
        harness = bench_harness()
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    code: int = harness.main(quick=args.quick, systems=args.systems, out=args.out,
                             workloads=args.workloads)
    return code


if __name__ == "__main__":
    sys.exit(main())
