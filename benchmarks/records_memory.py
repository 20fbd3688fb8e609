"""Host memory of a run on JSONL chat records as the corpus grows: the records are read as a
stream and packed rows kept on disk (``data/record_rows.py``), so peak memory should follow the
chunk and the batch, not the corpus.

For each corpus size, a JSONL file of chat records is written, then ``trainrun train`` runs on
it in a fresh process (the first run makes the packed rows; a second reads them), its resident
memory sampled every 10 ms from ``/proc``: ``RssAnon`` (the process's own memory) and
``VmRSS`` (that plus the file pages it has mapped: the packed rows, read through memory maps,
which the kernel may drop under pressure).

    python benchmarks/records_memory.py                  # corpora of 60 and 300 MB
    python benchmarks/records_memory.py --mb 60 300 --verify-resume
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORDS = ("tensor", "gradient", "optimizer", "checkpoint", "shard", "mesh", "device", "batch",
         "token", "layer", "attention", "residual", "norm", "scale", "rotary", "embedding",
         "kernel", "compile", "trace", "step", "epoch", "loss", "metric", "schedule", "warmup",
         "decay", "clip", "precision", "float", "accumulate", "resume", "process", "host")


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """Chat records (system, user, assistant; a few hundred bytes each) up to ``megabytes``."""
    rng = random.Random(seed)
    target = megabytes * 1_000_000
    written = records = 0
    with open(path, "w") as out:
        while written < target:
            question = " ".join(rng.choices(WORDS, k=rng.randint(6, 20)))
            answer = " ".join(rng.choices(WORDS, k=rng.randint(20, 80)))
            line = json.dumps({"messages": [
                {"role": "system", "content": "You answer questions about training runs."},
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer}]}) + "\n"
            out.write(line)
            written += len(line)
            records += 1
    return records


def status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_train(corpus: Path, run_dir: Path, cache: Path, steps: int) -> dict[str, float]:
    """``trainrun train`` on ``corpus``: wall seconds and peak RssAnon / VmRSS (MB)."""
    command = [sys.executable, "-m", "trainrun", "train", "--config", "chat", "--run-dir",
               str(run_dir), "data.synthetic=null", f"data.paths={corpus}", "data.seq_len=256",
               "model.seq_len=256", "data.batch_size=16", "data.eval_fraction=0.001",
               f"steps={steps}", "steps_per_call=10", f"metrics.every={steps}", "eval.every=0",
               f"checkpoint.every={steps}", "model.d_model=64", "model.layers=2",
               "optimizer.schedule.warmup=10"]
    env = {**os.environ, "TRAINRUN_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peaks = {"RssAnon": 0, "VmRSS": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            for key in peaks:
                peaks[key] = max(peaks[key], status_kb(proc.pid, key))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    done.set()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"train failed:\n{out[-3000:]}")
    line = next((ln for ln in out.splitlines() if ln.startswith("data: ")), "")
    return {"wall_s": time.perf_counter() - start, "anon_mb": peaks["RssAnon"] / 1024,
            "rss_mb": peaks["VmRSS"] / 1024, "data": line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[60, 300])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--verify-resume", action="store_true",
                        help="also kill -9 runs on the largest corpus and resume them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="records-memory-") as tmp:
        work = Path(tmp)
        cache = work / "cache"
        print("| corpus | records | packed rows on disk | run | wall s | peak RssAnon MB | "
              "peak VmRSS MB |")
        print("|---:|---:|---:|---|---:|---:|---:|")
        for mb in args.mb:
            corpus = work / f"chat-{mb}.jsonl"
            records = write_corpus(corpus, mb)
            for label in ("makes the rows", "reads them"):
                result = run_train(corpus, work / f"run-{mb}-{label[0]}", cache, args.steps)
                disk = sum(f.stat().st_size for f in (cache / "records").rglob("*.bin"))
                print(f"| {corpus.stat().st_size / 1e6:.0f} MB | {records:,} | "
                      f"{disk / 1e6:.0f} MB (all so far) | {label} | {result['wall_s']:.1f} | "
                      f"{result['anon_mb']:.0f} | {result['rss_mb']:.0f} |", flush=True)
            print(f"<!-- {result['data']} -->")
        if args.verify_resume:
            corpus = work / f"chat-{max(args.mb)}.jsonl"
            command = [sys.executable, "-m", "trainrun", "verify-resume", "--config", "chat",
                       "--work-dir", str(work / "verify"), "data.synthetic=null",
                       f"data.paths={corpus}", "data.seq_len=256", "model.seq_len=256",
                       "data.batch_size=16", "data.eval_fraction=0.001", "steps=60",
                       "steps_per_call=10", "eval.every=0", "checkpoint.every=20",
                       "model.d_model=64", "model.layers=2",
               "optimizer.schedule.warmup=10"]
            result = subprocess.run(command, env={**os.environ, "TRAINRUN_CACHE_DIR": str(cache)},
                                    capture_output=True, text=True)
            print(result.stdout[-3000:], result.stderr[-2000:])


if __name__ == "__main__":
    main()
