"""The ``trainrun`` command line: parse, then call the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import sys

from trainrun.errors import UserError


def _train(args: argparse.Namespace) -> int:
    from trainrun.config import load_config
    from trainrun.loop import run

    config = load_config(args.config, args.overrides)
    run(config, args.run_dir, fresh=args.fresh)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainrun",
        description="JAX training runs: fast, sharded, and resumable bit for bit.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = commands.add_parser(
        "train", help="run a training run (resumes one that has a checkpoint)",
        description="Train a config. Overrides are key.path=value, e.g. optimizer.lr=0.003.")
    train.add_argument("--config", default="mlp",
                       help="built-in config name (mlp, ...) or a path to a YAML file")
    train.add_argument("--run-dir", default=None,
                       help="where the run writes its files (default runs/<config name>)")
    train.add_argument("--fresh", action="store_true",
                       help="move an existing run in --run-dir aside and start over")
    train.add_argument("overrides", nargs="*", metavar="key.path=value")
    train.set_defaults(handler=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
