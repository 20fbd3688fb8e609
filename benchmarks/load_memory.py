"""Peak host memory while a Hugging Face model is loaded onto a mesh: trainrun's loader, which
reads each param a slice at a time and places it straight into its sharded device array
(``init_from.placed_params``), against reading the whole checkpoint into NumPy first and then
placing it (``safetensors.numpy.load_file`` + ``jax.device_put``), each in a fresh process.

    python benchmarks/load_memory.py                 # a Llama-shaped model of ~530 MB (float32)
    python benchmarks/load_memory.py --devices 4 --layers 6 --d-model 1024

On CPU the devices' arrays live in host memory too, so the model once on the devices is the
floor of what any loader needs; what a loader adds above it is its host copy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def rss_mb(kind: str = "VmRSS") -> float:
    """This process's resident memory (``RssAnon``: the part not backed by a file), MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class AnonPeak:
    """The highest anonymous resident memory seen while it runs, sampled every millisecond:
    the kernel keeps a peak of all resident memory only, which counts the model files' pages
    mapped while they are read (page cache, given back under pressure) with the copies."""

    def __init__(self) -> None:
        import threading

        self.peak = rss_mb("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_mb("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_mb("RssAnon"))


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, path: str, devices: int) -> None:
    """Load ``path`` onto ``devices`` simulated devices with FSDP; print one JSON line."""
    import jax

    from trainrun.checkpointing.init_from import model_of, placed_params, readers
    from trainrun.config import MeshConfig
    from trainrun.models import build_model
    from trainrun.models.huggingface import tensor_map
    from trainrun.program import sharding

    cfg = model_of(Path(path))
    model = build_model(cfg)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    mesh = sharding.build_mesh(MeshConfig(data=1, fsdp=devices, fsdp_min_size=0))
    shardings = sharding.param_shardings(mesh, abstract, model.logical_axes,
                                         MeshConfig(data=1, fsdp=devices, fsdp_min_size=0))
    jax.block_until_ready(jax.device_put(np.zeros(1), jax.devices()[0]))  # the backend is up
    base_rss, base_peak, base_anon = rss_mb(), peak_mb(), rss_mb("RssAnon")
    watch = AnonPeak()
    start = time.perf_counter()
    if mode == "placed":
        params = placed_params(readers(path, cfg, abstract), 0, abstract, shardings)
    else:
        from safetensors.numpy import load_file

        whole: dict[str, np.ndarray] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            whole.update(load_file(str(file)))
        sources = tensor_map(cfg, "llama")
        params = {}
        for keys, target in jax.tree_util.tree_flatten_with_path(shardings)[0]:
            name = ".".join(str(k.key) for k in keys)
            value = whole[sources[name].name]
            params[name] = jax.device_put(value.T if sources[name].transpose else value, target)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    anon_peak = watch.stop()
    on_devices = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
    print(json.dumps({"mode": mode, "seconds": seconds, "base_rss_mb": base_rss,
                      "rss_after_mb": rss_mb(), "peak_mb": peak_mb(),
                      "peak_before_mb": base_peak, "anon_start_mb": base_anon,
                      "anon_peak_mb": anon_peak,
                      "on_devices_mb": on_devices}))


def make_model(path: Path, layers: int, d_model: int, vocab: int) -> float:
    """A random Llama-shaped model directory written by trainrun's own writer; its MB."""
    from trainrun.config import TransformerModel
    from trainrun.models.huggingface import write_model_dir

    cfg = TransformerModel(vocab=vocab, d_model=d_model, layers=layers, heads=d_model // 64,
                           kv_heads=d_model // 256, mlp="swiglu", mlp_hidden=int(2.75 * d_model),
                           norm="rmsnorm", positions="rope", tie_embeddings=False,
                           seq_len=2048)
    import jax

    from trainrun.models import build_model

    rng = np.random.default_rng(0)
    abstract = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape, np.float32) * 0.02, abstract)
    write_model_dir(params, cfg, path, model_type="llama", shard_bytes=200 * 2**20)
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.devices)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        size = make_model(path, args.layers, args.d_model, args.vocab)
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
        rows = []
        for mode in ("placed", "whole", "placed", "whole"):  # interleaved, twice
            out = subprocess.run([sys.executable, __file__, "--devices", str(args.devices),
                                  "--child", mode, str(path)], env=env, capture_output=True,
                                 text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"model files: {size:.0f} MB (float32), {args.devices} simulated devices, FSDP over "
          "all of them\n")
    print("| loader | load s | on the devices MB | peak anonymous memory above start MB "
          "(/ files) | peak RSS above start MB (/ files), mapped file pages included |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        anon = row["anon_peak_mb"] - row["anon_start_mb"]
        rss = row["peak_mb"] - row["base_rss_mb"]
        print(f"| {row['mode']} | {row['seconds']:.1f} | {row['on_devices_mb']:.0f} | "
              f"{anon:.0f} ({anon / size:.2f}) | {rss:.0f} ({rss / size:.2f}) |")


if __name__ == "__main__":
    main()
