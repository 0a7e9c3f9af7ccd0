"""The ``tq-stream`` command: ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tq-stream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded streaming demo")
    demo.add_argument("--prompts", type=int, default=512)
    demo.add_argument("--group-size", type=int, default=8)
    bench = sub.add_parser("bench", help="run the benchmarks side by side")
    bench.add_argument("--quick", action="store_true", help="small shapes, seconds, no peers")
    bench.add_argument("--systems", default="", help="comma-separated subset of systems")
    bench.add_argument("--out", default="benchmarks/RESULTS.md")
    bench.add_argument("--workloads", default="",
                       help="comma-separated subset of bulk,small,streaming,controller,verl")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from tq_stream.demo import DemoConfig, run

        summary = run(DemoConfig(prompts=args.prompts, group_size=args.group_size))
        ok = summary["duplicates"] == 0 and summary["missing"] == 0
        return 0 if ok else 1
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError as exc:
        print(f"tq-stream bench needs the benchmarks package of a source checkout "
              f"(pip install -e '.[bench]'): {exc}", file=sys.stderr)
        return 2
    return bench_main(quick=args.quick, systems=args.systems, out=args.out,
                      workloads=args.workloads)


if __name__ == "__main__":
    sys.exit(main())
