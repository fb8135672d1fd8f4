"""The ``rayjobs`` command.

    rayjobs train [--config FILE] [--set key=value ...] [--summary PATH] [--print-config]

Exit status: 0 done; 1 the training failed; 2 bad input (one line per problem, no traceback,
before any Ray process starts).
"""

from __future__ import annotations

import argparse
import sys
import traceback

from rayjobs.errors import ConfigError, TrainingFailed


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="rayjobs", description="Ray-orchestrated scalable PyTorch trainer.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one run with Ray Train (TorchTrainer)")
    train.add_argument("--config", help="YAML config (default: the shipped digits job)")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field by dotted path, e.g. --set optim.lr=1e-3 (repeatable)",
    )
    train.add_argument("--summary", metavar="PATH", help="write the run summary as JSON here")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``rayjobs`` console script."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            _train(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"rayjobs: error: {problem}", file=sys.stderr)
        sys.exit(2)
    except TrainingFailed as exc:
        if exc.__cause__ is not None:  # the training's own error, not a user's config mistake: keep its trace
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"rayjobs: training failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("rayjobs: interrupted", file=sys.stderr)
        sys.exit(130)


def _train(args: argparse.Namespace) -> None:
    from rayjobs.config import load_config, to_yaml

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return
    from rayjobs import train

    summary = train.run(cfg)
    print(train.format_summary(summary), flush=True)
    if args.summary:
        train.write_summary(summary, args.summary)
        print(f"  summary:    {args.summary}")


if __name__ == "__main__":
    main()
