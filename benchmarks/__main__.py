"""``python -m benchmarks [NAMES] [--quick | --smoke] [--json PATH] [--chart PATH]``: what ``rayjobs bench`` runs.

Benchmarks import rayjobs' public pieces; rayjobs never imports benchmarks (``rayjobs bench``
starts this module in its own process).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.base import FULL, QUICK, SMOKE
from rayjobs import log


def main(argv: list[str] | None = None) -> int:
    """Run the named benchmarks (all by default), print the table, write the JSON and the chart."""
    parser = argparse.ArgumentParser(prog="rayjobs bench", description="side-by-side benchmarks (ratios, with goals)")
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="short runs (about 5 minutes on 2 cores)")
    parser.add_argument(
        "--smoke", action="store_true", help="each benchmark's code path at its smallest (figures not comparable)"
    )
    parser.add_argument("--json", metavar="PATH", default="results/bench.json", help="where to write the figures")
    parser.add_argument("--chart", metavar="PATH", help="PNG chart (default: beside --json)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick and args.smoke:
        log.error("bench: --quick and --smoke are two sizes of a run; give one of them")
        return 2
    known = list(harness.load_all())
    unknown = [n for n in args.names if n not in known]
    if unknown:
        log.error(f"bench: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return 2
    size = SMOKE if args.smoke else QUICK if args.quick else FULL
    results = harness.run(args.names, size)
    print(harness.format_table(results))
    harness.write_json(results, args.json)
    chart = args.chart or str(Path(args.json).with_suffix(".png"))
    harness.draw_chart(results, chart)
    timelines = str(Path(chart).with_name(Path(chart).stem + "-timeline.png"))
    drawn = harness.draw_timelines(results, timelines)
    print(f"\nbench: figures in {args.json}, chart in {chart}" + (f", launch timeline in {timelines}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
