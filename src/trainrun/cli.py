"""The ``trainrun`` command line: parse, then call the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import sys

from trainrun.errors import UserError


def _train(args: argparse.Namespace) -> int:
    from trainrun.config import load_config
    from trainrun.distributed import session
    from trainrun.loop import run

    config = load_config(args.config, args.overrides)
    with session(config.distributed):  # joins the other processes, if any, before JAX starts
        run(config, args.run_dir, fresh=args.fresh)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from trainrun.distributed import launch

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    return launch(args.n, command, args.devices_per_process, args.grace_s)


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

    launch = commands.add_parser(
        "launch", help="run one training run as N processes on this machine (CPU)",
        description="Start N processes of one run (jax.distributed, CPU collectives over gloo, "
                    "a coordinator on 127.0.0.1), stream their output prefixed [i], and exit "
                    "non-zero if any fails. Example: trainrun launch -n 2 "
                    "--devices-per-process 2 -- train --config mlp")
    launch.add_argument("-n", type=int, required=True, help="number of processes")
    launch.add_argument("--devices-per-process", type=int, default=None,
                        help="simulated CPU devices in each process (default: JAX's, one)")
    launch.add_argument("--grace-s", type=float, default=90.0,
                        help="after one process fails, seconds the others get to stop by "
                             "themselves before they are terminated")
    launch.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- train ...")
    launch.set_defaults(handler=_launch)
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
