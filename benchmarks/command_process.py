"""Whole commands in the ``trainrun`` program's own process (``cli.command``, which makes
``command_process``'s settings: the objects alive at the command's start and end left out of
Python's collector, tensorboardX's bucket clients left unloaded) against the same commands
through ``cli.main`` in a process as Python makes it.

    python benchmarks/command_process.py [--rounds 8] [--steps 4]

A chat run is trained once (compiled-program cache off) for ``sample`` and ``eval`` to read,
and every command runs once first to fill a compiled-program cache, so each timed command is a
warm one (what a second identical command costs); ``train`` makes a new run directory each time.
``config show`` starts no JAX backend. In every round each command runs once per contender, the
contenders alternating which goes first. The table gives the median wall and CPU time (user and
system of the command's process) and the ratio; each command's output is compared across the
contenders (losses, answer, scores, the shown config): the settings must not change a bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from compile_cache import Command, chat_commands, timed, trainrun
from machine_line import machine

# Each contender's process: the console script, or main() in a process as Python makes it.
CONTENDERS = {
    "program": [str(Path(sys.executable).parent / "trainrun")],
    "main()": [sys.executable, "-c", "import sys; from trainrun.cli import main; "
               "sys.exit(main(sys.argv[1:]))"],
}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="steps per train (default 4)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 2:
        parser.error("give --rounds >= 1 and --steps >= 2")
    return args


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory(prefix="command-process-",
                                     ignore_cleanup_errors=True) as folder:
        measure(args, Path(folder))


def measure(args: argparse.Namespace, folder: Path) -> None:
    env, chat_run = chat_commands(folder, args.steps)
    env["TRAINRUN_COMPILATION_CACHE"] = str(folder / "programs")
    commands: dict[str, Command] = {
        "config show": lambda out: (["config", "show", "--config", "chat"], lambda s: s),
        **chat_run,
    }
    for name, command in commands.items():  # fill the compiled-program cache
        trainrun(command(folder / f"fill-{name.replace(' ', '-')}")[0], env)
    wall = {(n, c): [] for n in commands for c in CONTENDERS}
    cpu = {(n, c): [] for n in commands for c in CONTENDERS}
    for round_ in range(args.rounds):
        order = list(CONTENDERS) if round_ % 2 == 0 else list(reversed(CONTENDERS))
        for name, command in commands.items():
            results = {}
            for contender in order:
                out = folder / f"out-{name.replace(' ', '-')}-{round_}-{contender[:4]}"
                argv, result = command(out)
                seconds, used, stdout = timed([*CONTENDERS[contender], *argv], env)
                wall[name, contender].append(seconds)
                cpu[name, contender].append(used)
                results[contender] = result(stdout)
            if len({repr(r) for r in results.values()}) != 1:
                sys.exit(f"{name}: the contenders' results differ:\n{results}")
    print(f"\n{machine()}; {args.rounds} rounds, median; the same results from both")
    print("| command | wall: program | main() | program / main() | CPU: program | main() "
          "| program / main() |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in commands:
        w = {c: statistics.median(wall[name, c]) for c in CONTENDERS}
        u = {c: statistics.median(cpu[name, c]) for c in CONTENDERS}
        print(f"| `trainrun {name}` | {w['program']:.2f} s | {w['main()']:.2f} s | "
              f"{w['program'] / w['main()']:.2f}x | {u['program']:.2f} s | {u['main()']:.2f} s "
              f"| {u['program'] / u['main()']:.2f}x |")


if __name__ == "__main__":
    main()
