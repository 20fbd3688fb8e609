"""Preference tuning (DPO): its step against a plain next-token step, its host memory against
SFT's, and trainrun against TRL's ``DPOTrainer``.

    python benchmarks/preference.py steps [--rounds 10]
    python benchmarks/preference.py memory [--rounds 2]
    python benchmarks/preference.py trl [--rounds 5] [--steps 10]

The model everywhere is a random tiny Llama (vocabulary 512, 2 layers x 128, 4 query heads
sharing 2 key/value heads, SwiGLU 256, RMSNorm, rotary positions, an untied head), float32;
a batch is 8 pairs of random token ids (prompts of 25-40 tokens, each answer 16-40 ending in
the end token), one pair a row of 121 tokens (the longest pair: its prompt once, both answers
and the prompt's last token again), as ``data/pair_rows.py`` lays a pair out.

``steps``: the jitted training step (``program/step.py``, the state donated, 10 calls a
measurement ending in ``block_until_ready``) of the DPO loss with the cached reference column
against the next-token loss over the same rows, counting the same answer tokens
(``loss_mask``); and the reference pass that fills the column (``compute_reference``'s jitted
forward pass, 64 rows a pass as ``preference.reference_batch_size`` defaults; and the whole
``compute_reference`` of 640 rows, its compile included) per pair against the DPO step per
pair. One process, interleaved rounds after a warmup call of each.

``memory``: peak host memory (``ru_maxrss``) of whole LoRA runs (``trainrun.run``, rank 8 on
every linear layer, 2 layers x 256) each in a fresh process: the ``dpo`` config on pairs
against the ``chat`` config on the same prompts with the chosen answers, as the preference
guide makes them; the DPO run's reference column computed in it. Interleaved, ``--rounds``
times each.

``trl``: the same model (one Hugging Face directory, written by trainrun), the same pairs in
the same order, 8 a step, AdamW (lr 1e-3, no schedule, no clipping, no weight decay), float32,
the reference computed once before training by both (TRL's ``precompute_ref_log_probs``):
trainrun's jitted step on the host's packed rows, one step a call, read after the last as the
loop reads its metrics without waiting between steps, against ``DPOTrainer.train`` (PyTorch
eager at its default thread count and at 1 thread, sequential order). Tokens a second count
each pair's two sequences (its prompt twice and both answers, as TRL computes them) over steps
2 to the last, for both contenders; the losses of
every step are printed side by side. Interleaved rounds, each contender from the same start.
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from machine_line import machine
from trl_rounds import interleaved

from trainrun.config import OptimizerConfig, RunConfig, load_config
from trainrun.data.pair_rows import pack_pairs
from trainrun.data.preference_pairs import Pair
from trainrun.models import build_model
from trainrun.models.preference_transformer import REFERENCE_COLUMN, make_preference_transformer
from trainrun.models.token_logps import PAIR_ROW_ARRAYS, pair_rows, token_logps
from trainrun.models.transformer import bind_transformer
from trainrun.platform.process import configure_process
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import Policy
from trainrun.program.state import state_from_params
from trainrun.program.step import make_train_step
from trainrun.training.preference_data import compute_reference

VOCAB, EOS, PAIRS_PER_STEP, ROW = 512, 2, 8, 121
MODEL = ["model.vocab=512", "model.d_model=128", "model.layers=2", "model.heads=4",
         "model.kv_heads=2", "model.mlp_hidden=256", "model.seq_len=160", "data.seq_len=120",
         "model.dropout=0.0"]
ADAMW = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.0, clip_norm=None)


def pairs(count: int, seed: int = 0) -> list[Pair]:
    """Random pairs of token ids, each fitting a row of ``ROW`` tokens."""
    rng = np.random.default_rng(seed)

    def answer() -> np.ndarray:
        return np.append(rng.integers(3, VOCAB, rng.integers(15, 40)), EOS).astype(np.uint32)

    return [Pair(rng.integers(3, VOCAB, rng.integers(25, 41)).astype(np.uint32), answer(),
                 answer()) for _ in range(count)]


def rows_of(batch: list[Pair]) -> dict[str, np.ndarray]:
    """One pair a row, so every batch has one shape."""
    rows = [pack_pairs([pair], ROW, bins=1)[0] for pair in batch]
    return {name: np.concatenate([row[name] for row in rows]) for name in rows[0]}


def dpo_config() -> RunConfig:
    """The ``dpo`` config at the benchmark's model, DPO alone (no next-token term)."""
    return load_config("dpo", [*MODEL, "preference.nll_weight=0.0"])


def jitted_step(model: Any) -> Callable[[Any, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    """The loop's step, jitted with the state donated."""
    return jax.jit(make_train_step(model, build_optimizer(ADAMW, 1000)), donate_argnums=0)


# ---- steps: the DPO step against a next-token step, the reference pass against a step ----


def steps(rounds: int) -> None:
    config = dpo_config()
    dpo = make_preference_transformer(config.model, config.preference)
    sft = build_model(config.model)
    params = jax.jit(sft.init)(jax.random.key(0))
    rows = rows_of(pairs(PAIRS_PER_STEP))
    column = compute_reference(config, Policy(), params, rows, 64).view(np.int32)
    batches = {"DPO (cached reference)": {**rows, REFERENCE_COLUMN: column},
               "next-token, same answer tokens": {
                   **{k: rows[k] for k in ("tokens", "segment_ids", "positions")},
                   "loss_mask": (rows["answer"] > 0).astype(np.int32)}}
    models = {"DPO (cached reference)": dpo, "next-token, same answer tokens": sft}
    contenders: dict[str, Callable[[], float]] = {}
    for name, model in models.items():
        step = jitted_step(model)
        state = [state_from_params(params, build_optimizer(ADAMW, 1000), 0)]
        batch = jax.device_put(batches[name])
        state[0], metrics = step(state[0], batch)  # warmup: compile
        jax.block_until_ready(metrics)

        def measure(step: Any = step, state: list[Any] = state, batch: Any = batch) -> float:
            start = time.perf_counter()
            for _ in range(10):
                state[0], metrics = step(state[0], batch)
            jax.block_until_ready(metrics)
            return (time.perf_counter() - start) / 10

        contenders[name] = measure
    reference_rows = {k: np.tile(v, (8, 1)) for k, v in rows.items()}  # 64 rows: one pass
    bind = bind_transformer(config.model)
    scored = jax.jit(lambda p, b: jnp.pad(token_logps(bind(p), pair_rows(b))[0],
                                          ((0, 0), (1, 0))))
    one_pass = jax.device_put({name: reference_rows[name] for name in PAIR_ROW_ARRAYS})
    np.asarray(scored(params, one_pass))  # warmup: compile

    def reference() -> float:  # compute_reference's pass, as it runs after its first
        start = time.perf_counter()
        for _ in range(10):
            np.asarray(scored(params, one_pass))
        return (time.perf_counter() - start) / 10 / 64 * PAIRS_PER_STEP

    many_rows = {k: np.tile(v, (80, 1)) for k, v in rows.items()}  # 640 rows: 10 passes

    def whole() -> float:
        start = time.perf_counter()
        compute_reference(config, Policy(), params, many_rows, 64)
        return (time.perf_counter() - start) / 640 * PAIRS_PER_STEP

    contenders["reference pass (64 rows), per 8 pairs"] = reference
    contenders["compute_reference of 640 rows, compile included, per 8 pairs"] = whole
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, measure in contenders.items():
            times[name].append(measure())
    print(f"{machine()}; {rounds} interleaved rounds of 10 calls, batch of 8 pairs")
    dpo_ms = statistics.median(times["DPO (cached reference)"])
    print("| contender | ms per 8 pairs best / median | / DPO step (median) |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {min(values) * 1e3:.2f} / {statistics.median(values) * 1e3:.2f} | "
              f"{statistics.median(values) / dpo_ms:.2f}x |")
    sft_ms = statistics.median(times["next-token, same answer tokens"])
    print(f"DPO step / next-token step: {dpo_ms / sft_ms:.2f}x (target <= 1.1x)")


# ---- memory: peak RSS of a LoRA DPO run against a LoRA SFT run -----------------------------


def guide_data(folder: Path) -> tuple[Path, Path]:
    """The preference guide's pairs and, for SFT, the same prompts with the chosen answers."""
    import random

    rng = random.Random(0)
    with open(folder / "sft.jsonl", "w") as sft, open(folder / "pairs.jsonl", "w") as out:
        for _ in range(2048):
            word = "".join(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(4, 7)))
            other = rng.choice(word[:-1])
            prompt = [{"role": "user", "content": f"last {word}"}]
            chosen = [{"role": "assistant", "content": word[-1]}]
            sft.write(json.dumps({"messages": [*prompt, *chosen]}) + "\n")
            out.write(json.dumps({"prompt": prompt, "chosen": chosen,
                                  "rejected": [{"role": "assistant", "content": other}]})
                      + "\n")
    return folder / "pairs.jsonl", folder / "sft.jsonl"


MEMORY_MODEL = ["model.d_model=256", "model.layers=2", "model.heads=4", "model.seq_len=128",
                "data.seq_len=128", "data.batch_size=16", "steps=50", "steps_per_call=25",
                "eval.every=0", "checkpoint.every=50", "metrics.every=25",
                "model.lora={rank: 8, targets: all-linear}", "data.synthetic=null"]


def memory_child(kind: str, folder: Path) -> None:
    from trainrun.training.loop import run

    pairs_file, sft_file = folder / "pairs.jsonl", folder / "sft.jsonl"
    base, data = ("dpo", pairs_file) if kind == "dpo" else ("chat", sft_file)
    config = load_config(base, [*MEMORY_MODEL, f"data.paths=[{data}]"])
    start = time.perf_counter()
    with open(os.devnull, "w") as quiet:
        run(config, folder / f"run-{kind}-{os.getpid()}", fresh=True, out=quiet)
    print(json.dumps({"maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "wall_s": time.perf_counter() - start}))


def memory(rounds: int) -> None:
    peaks: dict[str, list[dict[str, float]]] = {"dpo": [], "sft": []}
    with tempfile.TemporaryDirectory() as tmp:
        guide_data(Path(tmp))
        for _ in range(rounds):
            for kind in peaks:
                done = subprocess.run([sys.executable, __file__, "_memory_child", kind, tmp],
                                      capture_output=True, text=True, check=True)
                peaks[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{machine()}; each run in a fresh process, {rounds} interleaved rounds")
    print("| run | peak RSS MB (ru_maxrss), each round | wall s, each round |\n|---|---:|---:|")
    names = {"dpo": "LoRA DPO (`dpo`, cached reference)", "sft": "LoRA SFT (`chat`)"}
    for kind, rows in peaks.items():
        peak = " / ".join(f"{r['maxrss_mb']:.0f}" for r in rows)
        wall = " / ".join(f"{r['wall_s']:.1f}" for r in rows)
        print(f"| {names[kind]} | {peak} | {wall} |")
    ratio = (statistics.median(r["maxrss_mb"] for r in peaks["dpo"])
             / statistics.median(r["maxrss_mb"] for r in peaks["sft"]))
    print(f"DPO / SFT peak (medians): {ratio:.2f}x (target <= 1.1x)")


# ---- trl: trainrun against TRL's DPOTrainer ----------------------------------------------


def hf_dir(path: Path) -> Path:
    from trainrun.models.huggingface import write_model_dir

    cfg = dpo_config().model
    params = jax.device_get(build_model(cfg).init(jax.random.key(0)))
    return write_model_dir(params, cfg, path, model_type="llama")


def trainrun_contender(path: Path, data: list[Pair], count: int) -> tuple[list[float], float]:
    """Losses of ``count`` steps and seconds of steps 2 to the last, from ``path``."""
    import trainrun

    loaded = trainrun.load(path)
    config = dpo_config()
    model = make_preference_transformer(loaded.config, config.preference)
    batches = [rows_of(data[i * PAIRS_PER_STEP:(i + 1) * PAIRS_PER_STEP]) for i in range(count)]
    for rows in batches:
        rows[REFERENCE_COLUMN] = compute_reference(config, Policy(), loaded.params, rows,
                                                   64).view(np.int32)
    step = jitted_step(model)
    state = state_from_params(loaded.params, build_optimizer(ADAMW, 1000), 0)
    state, metrics = step(state, batches[0])
    losses = [metrics["loss"]]
    jax.block_until_ready(losses)
    start = time.perf_counter()
    for rows in batches[1:]:  # as the loop runs: no wait for the device between steps
        state, metrics = step(state, rows)
        losses.append(metrics["loss"])
    jax.block_until_ready(losses)
    return [float(loss) for loss in losses], time.perf_counter() - start


def trl_contender(path: Path, data: list[Pair], count: int, out: Path) -> tuple[list[float],
                                                                                 float]:
    import datasets
    import tokenizers
    import transformers
    import trl

    # one word a token id, "<id>": a special token matches inside any word ("t2" in "t263")
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"<{i}>": i for i in range(VOCAB)}, unk_token="<0>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<2>",
                                                     pad_token="<0>", unk_token="<0>")

    def text(ids: np.ndarray, lead: str = "") -> str:
        return lead + " ".join(f"<{i}>" for i in ids)

    used = data[:count * PAIRS_PER_STEP]
    dataset = datasets.Dataset.from_dict({  # answers end in <2>: no end token added
        "prompt": [text(p.prompt) for p in used], "chosen": [text(p.chosen, " ") for p in used],
        "rejected": [text(p.rejected, " ") for p in used]})
    args = trl.DPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to=[], per_device_train_batch_size=PAIRS_PER_STEP, max_steps=count,
        learning_rate=ADAMW.lr, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, beta=0.1, max_length=None, precompute_ref_log_probs=True,
        train_sampling_strategy="sequential", logging_steps=count, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    marks: list[float] = []
    losses: list[float] = []

    class Timed(transformers.TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            marks.append(time.perf_counter())

    class Recorded(trl.DPOTrainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, *rest: Any, **kw: Any) -> Any:
            loss = super().compute_loss(model, inputs, *rest, **kw)
            losses.append(float(loss.detach()))
            return loss

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    trainer = Recorded(model=model, args=args, train_dataset=dataset,
                       processing_class=tokenizer, callbacks=[Timed()])
    trainer.train()
    return losses, marks[-1] - marks[0]


def against_trl(rounds: int, count: int) -> None:
    import torch
    import trl

    data = pairs(count * PAIRS_PER_STEP, seed=1)
    tokens = sum(2 * p.prompt.size + p.chosen.size + p.rejected.size
                 for p in data[PAIRS_PER_STEP:count * PAIRS_PER_STEP])
    with tempfile.TemporaryDirectory() as tmp:
        path = hf_dir(Path(tmp) / "llama")
        results, threads = interleaved(rounds, lambda: trainrun_contender(path, data, count),
                                       lambda out: trl_contender(path, data, count, out),
                                       Path(tmp))
    print(f"{machine()}; torch {torch.__version__} ({threads} threads by default), "
          f"trl {trl.__version__}; {rounds} interleaved rounds of {count} steps")
    speed = {name: [tokens / s for _, s in runs] for name, runs in results.items()}
    print("| contender | tokens/s best / median (steps 2-last) | each round | / TRL (median) |"
          "\n|---|---:|---:|---:|")
    trl_median = statistics.median(speed["TRL"])
    for name, values in speed.items():
        each = " / ".join(f"{v:,.0f}" for v in values)
        print(f"| {name} | {max(values):,.0f} / {statistics.median(values):,.0f} | {each} | "
              f"{statistics.median(values) / trl_median:.2f}x |")
    ours, theirs = results["trainrun"][0][0], results["TRL"][0][0]
    print("\n| step | trainrun loss | TRL loss | difference |\n|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        print(f"| {i} | {a:.6f} | {b:.6f} | {a - b:+.1e} |")
    worst = max(abs(a - b) for name in results if name != "trainrun"
                for run_a, run_b in zip(results["trainrun"], results[name], strict=True)
                for a, b in zip(run_a[0], run_b[0], strict=True))
    print(f"largest loss difference over every round: {worst:.1e} (target <= 1e-4)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_memory_child":
        configure_process()
        memory_child(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["steps", "memory", "trl"])
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    configure_process()  # as `trainrun train` does, before the first computation
    if args.what == "steps":
        steps(args.rounds or 10)
    elif args.what == "memory":
        memory(args.rounds or 2)
    else:
        against_trl(args.rounds or 5, args.steps)


if __name__ == "__main__":
    main()
