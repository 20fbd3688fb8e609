"""Whole commands with JAX's persistent compilation cache: ``trainrun train``, ``sample`` and
``eval`` on the built-in chat config at a few steps, each without the cache
(``TRAINRUN_COMPILATION_CACHE=0``), from an empty cache folder (cold) and again from the folder
the cold command filled (warm).

    python benchmarks/compile_cache.py [--rounds 3] [--steps 4] [--min-compile-s 0 1 ...]

A chat run is trained once here (cache off) for ``sample`` and ``eval`` to read; ``train``
makes a new run directory each time. Every round runs each command off, then cold and warm
for each least compile time a program needs to be kept (``--min-compile-s``, given to JAX as
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``; trainrun's own is 0), one after the other:
the rounds interleave the variants. The table gives the median wall time and CPU time (user
and system, the command's process and its children) of each, the warm command's against the
cold one's, and the programs the cold one kept. Each command's output is compared across all
variants (the losses of ``train``, the answer of ``sample``, the scores of ``eval``): the
cache must not change a bit.

Every round also times the floor no command goes below, cache or not: a Python process that
imports JAX and runs one tiny program (its CPU backend started), then exits. The last column
compares what the commands spend above it. And for each command, the floor of its own imports:
a process that imports every module the command had imported by its end (recorded from one
warm run of it), then runs the same tiny program. A warm command cannot take less than that,
so its time against the cold command's is the least warm / cold a cache could give.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="steps per train (default 4)")
    parser.add_argument("--min-compile-s", type=float, nargs="+", default=[0.0],
                        help="least compile times for a program to be kept, each measured "
                             "(default: trainrun's, 0)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 2:
        parser.error("give --rounds >= 1 and --steps >= 2")
    return args


def chat(run_dir: Path, steps: int) -> list[str]:
    return ["train", "--config", "chat", "--run-dir", str(run_dir), f"steps={steps}",
            f"steps_per_call={steps // 2}", "eval.every=0", "metrics.every=1",
            "checkpoint.every=0", "optimizer.schedule.warmup=1"]


def cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def trainrun(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """``trainrun ARGV`` in a fresh process: its wall time, its CPU time and its stdout."""
    return timed([str(Path(sys.executable).parent / "trainrun"), *argv], env)


FLOOR = "import jax; jax.numpy.zeros(()).block_until_ready()"

# ``trainrun ARGV`` run to its end as the program runs it, then the names of the modules it
# imported, in their order.
RECORD_IMPORTS = """
import json, sys
from trainrun.cli import command
try:
    command(json.loads(sys.argv[1]))
finally:
    with open(sys.argv[2], "w") as f:
        json.dump(list(sys.modules), f)
"""

# Those modules imported again as the program would (what it left out of tensorboardX's import
# left out here too), then the floor's tiny program.
IMPORTS_FLOOR = """
import gc, importlib, json, sys
from trainrun.reporting.sinks.tensorboard import TENSORBOARDX_BUCKET_CLIENTS
gc.freeze()
names = json.load(open(sys.argv[1]))
for left_out in ("torch", *TENSORBOARDX_BUCKET_CLIENTS):
    if left_out not in names:
        sys.modules[left_out] = None
for name in names:
    if name not in sys.modules and not name.endswith("__main__"):
        try:
            importlib.import_module(name)
        except Exception:
            pass
import jax
jax.numpy.zeros(()).block_until_ready()
gc.freeze()
"""


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """``command`` in a fresh process: its wall time, its CPU time and its stdout."""
    start, cpu = time.perf_counter(), cpu_seconds()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return seconds, cpu, done.stdout


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text()
            .splitlines() if "loss" in json.loads(line)]


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory(prefix="compile-cache-", ignore_cleanup_errors=True) as folder:
        measure(args, Path(folder))


# A command, given the folder for its output: its arguments, and how to read its result from
# its stdout.
Command = Callable[[Path], tuple[list[str], Callable[[str], object]]]


def chat_commands(folder: Path, steps: int) -> tuple[dict[str, str], dict[str, Command]]:
    """A chat run trained in ``folder / "chat"`` (compiled-program cache off), and the
    environment and commands that measure: ``train`` into a new run directory, ``sample`` and
    ``eval`` on that run. The environment is this process's without JAX's cache settings, with
    a user cache of its own in ``folder`` (the chat records, made once)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"}
    env["TRAINRUN_CACHE_DIR"] = str(folder / "user-cache")
    trainrun(chat(folder / "chat", steps), {**env, "TRAINRUN_COMPILATION_CACHE": "0"})
    commands: dict[str, Command] = {
        "train": lambda out: (chat(out, steps), lambda stdout: losses(out)),
        "sample": lambda out: (["sample", str(folder / "chat"), "--chat", "reverse hello",
                                "--tokens", "16"], lambda stdout: stdout),
        "eval": lambda out: (["eval", str(folder / "chat"), "--tokens", "16", "--limit", "32",
                              "--out", str(out)],
                             lambda stdout: (out / "scores.json").read_text()),
    }
    return env, commands


def measure(args: argparse.Namespace, folder: Path) -> None:
    base, commands = chat_commands(folder, args.steps)
    variants = ["off"] + [f"{kind} {least:g}" for least in args.min_compile_s
                          for kind in ("cold", "warm")]
    wall: dict[tuple[str, str], list[float]] = {(n, v): [] for n in commands for v in variants}
    cpu: dict[tuple[str, str], list[float]] = {(n, v): [] for n in commands for v in variants}
    kept: dict[tuple[str, str], list[int]] = {(n, v): [] for n in commands for v in variants}
    floor: list[float] = []
    imported = record_imports(folder, base, commands)
    imports: dict[str, list[float]] = {name: [] for name in commands}
    for round_ in range(args.rounds):
        floor.append(timed([sys.executable, "-c", FLOOR], base)[0])
        for name in commands:
            imports[name].append(timed([sys.executable, "-c", IMPORTS_FLOOR,
                                        str(imported[name])], base)[0])
        for name, command in commands.items():
            results = []
            for variant in variants:
                kind, _, least = variant.partition(" ")
                cache = folder / f"programs-{name}-{round_}-{least}"
                env = {**base, "TRAINRUN_COMPILATION_CACHE": "0" if kind == "off" else
                       str(cache)}
                if kind != "off":
                    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = least
                out = folder / f"out-{name}-{round_}-{variant.replace(' ', '-')}"
                argv, result = command(out)
                seconds, used, stdout = trainrun(argv, env)
                wall[name, variant].append(seconds)
                cpu[name, variant].append(used)
                results.append(result(stdout))
                kept[name, variant].append(len(list(cache.glob("*-cache"))))
            if any(r != results[0] for r in results):
                sys.exit(f"{name}: the cache changed the result:\n{results}")
    least_wall = statistics.median(floor)
    print(f"\n{args.rounds} round(s), chat config at {args.steps} steps; median wall and CPU "
          "time, the same results in every variant; the floor (Python, JAX imported, one tiny "
          f"program): {least_wall:.2f} s wall")
    print("| command | least compile time kept | wall: off | cold | warm | warm / cold "
          "| CPU: off | cold | warm | warm / cold | programs kept | wall above the floor: "
          "warm / cold |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in commands:
        for least in args.min_compile_s:
            cold, warm = f"cold {least:g}", f"warm {least:g}"
            w = {v: statistics.median(wall[name, v]) for v in ("off", cold, warm)}
            c = {v: statistics.median(cpu[name, v]) for v in ("off", cold, warm)}
            print(f"| `trainrun {name}` | {least:g} s | {w['off']:.2f} s | {w[cold]:.2f} s | "
                  f"{w[warm]:.2f} s | {w[warm] / w[cold]:.2f}x | {c['off']:.2f} s | "
                  f"{c[cold]:.2f} s | {c[warm]:.2f} s | {c[warm] / c[cold]:.2f}x | "
                  f"{statistics.median(kept[name, cold]):.0f} | "
                  f"{(w[warm] - least_wall) / (w[cold] - least_wall):.2f}x |")
    print("\nEach command's imports alone (median wall), against the cold command: the least "
          "warm / cold any cache could give")
    print("| command | imports alone | cold | warm | imports / cold | warm / cold |")
    print("|---|---:|---:|---:|---:|---:|")
    least = f"{args.min_compile_s[0]:g}"
    for name in commands:
        alone = statistics.median(imports[name])
        cold = statistics.median(wall[name, f"cold {least}"])
        warm = statistics.median(wall[name, f"warm {least}"])
        print(f"| `trainrun {name}` | {alone:.2f} s | {cold:.2f} s | {warm:.2f} s | "
              f"{alone / cold:.2f}x | {warm / cold:.2f}x |")


def record_imports(folder: Path, env: dict[str, str],
                   commands: dict[str, Command]) -> dict[str, Path]:
    """Each command run once with a cache of its own filled (so the record is a warm run's),
    and the file of the modules it imported."""
    files = {}
    for name, command in commands.items():
        cached = {**env, "TRAINRUN_COMPILATION_CACHE": str(folder / f"programs-{name}-imports")}
        files[name] = folder / f"imports-{name}.json"
        for run in ("fill", "record"):
            argv, _ = command(folder / f"out-{name}-imports-{run}")
            timed([sys.executable, "-c", RECORD_IMPORTS, json.dumps(argv), str(files[name])],
                  cached)
    return files

if __name__ == "__main__":
    main()
