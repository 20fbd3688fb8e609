"""Reinforcement learning (GRPO): a step (rollouts drawn, scored, one update) against TRL's
``GRPOTrainer``, and the parts of trainrun's step: the rollout batch, the update, and a
next-token step over the same tokens.

    python benchmarks/grpo.py trl [--rounds 3] [--steps 6]
    python benchmarks/grpo.py parts [--rounds 10]

The model everywhere is the ``grpo`` config's transformer at 2 layers x 128 (4 query heads
sharing 2 key/value heads, SwiGLU 256, RMSNorm, rotary positions, an untied head, the byte
tokenizer's 264-token vocabulary), random, float32. A step draws G = 8 completions of each of
4 prompts (the ``grpo`` config's own ``last <letters>`` chat prompts, 28-31 tokens, left-padded
to the longest), each completion 32 tokens long (no stop token ends one early: trainrun with
no stop ids, TRL with ``min_new_tokens``), at temperature 1, scored by ``format_regex`` (1 for
a vowel in the completion's text), and takes one update with the ``grpo`` config's optimizer
(AdamW, lr 1e-3 constant, betas 0.9/0.98, no weight decay, gradients clipped at norm 1) and
loss (``dapo``, beta 0: no reference).

``trl``: trainrun's step as the run takes it (``RolloutBatches`` following the state: the
decoder's rollouts, the rewards and advantages on the host, then the jitted step, the state
donated; with one update a rollout batch no old log-probabilities are computed) against
``GRPOTrainer.train`` on the same weights (one Hugging Face directory, written by trainrun)
and the same prompts in the same order, its generation by ``transformers``' ``generate``
(PyTorch eager, at its default thread count and at 1 thread). Time per step over steps 2 to
the last; interleaved rounds, each contender from the same start.

``parts``: in one process, interleaved rounds after a warmup call of each: a rollout batch
(``RolloutBatches.draw``: generation and the rewards), the old log-probabilities' forward pass
that a run of several updates a batch adds to it (``completion_logps``), the update (the
jitted step on that batch, 10 calls a measurement ending in ``block_until_ready``) and a
next-token step over the same rows (each prompt and its completion, the completion's tokens
the targets). Generation's share of the step is the rollout batch over the rollout batch plus
the update.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from machine_line import machine
from trl_rounds import interleaved

from trainrun.config import RunConfig, load_config
from trainrun.data.prompt_records import Prompt, prompt_records
from trainrun.models import build_model
from trainrun.models.grpo_transformer import make_grpo_transformer
from trainrun.platform.process import configure_process
from trainrun.program.optim import build_optimizer
from trainrun.program.rollouts import completion_logps
from trainrun.program.state import TrainState, state_from_params
from trainrun.program.step import make_train_step
from trainrun.training.rollout_batches import RolloutBatches

GROUP, PROMPTS, COMPLETION = 8, 4, 32
VOWEL = "[aeiou]"  # the reward: a vowel in the completion, found in some and not others
ROWS = GROUP * PROMPTS
SETTINGS = ["model.d_model=128", "model.layers=2", "model.heads=4", "model.kv_heads=2",
            "model.mlp_hidden=256", "model.seq_len=96", "data.seq_len=96",
            f"rl.group={GROUP}", f"rl.prompts={PROMPTS}", f"rl.completion_tokens={COMPLETION}",
            f"rl.rewards=[{{name: format_regex, args: {{pattern: '{VOWEL}'}}}}]"]


def grpo_config() -> RunConfig:
    return load_config("grpo", SETTINGS)


def prompts(config: RunConfig, count: int) -> list[Prompt]:
    """The first ``count`` of the ``grpo`` config's training prompts."""
    found = prompt_records(config.data, config.data.seq_len - COMPLETION)
    return found.train[:count]


def rollout_batches(config: RunConfig, pool: list[Prompt]) -> RolloutBatches:
    """The run's batch iterator over ``pool``, every completion drawn to its full length."""
    batches = RolloutBatches(config, pool)
    batches.settings = dataclasses.replace(batches.settings, stop_ids=())
    return batches


def jitted_step(config: RunConfig, model: Any,
                ) -> Callable[[TrainState, dict[str, Any]], tuple[TrainState, Any]]:
    """The loop's step with the config's optimizer, jitted with the state donated."""
    optimizer = build_optimizer(config.optimizer, config.steps)
    return jax.jit(make_train_step(model, optimizer), donate_argnums=0)


def fresh_state(config: RunConfig, params: Any) -> TrainState:
    """A state at step 0 around a copy of ``params`` (the step donates its state)."""
    return state_from_params(jax.tree.map(lambda x: x.copy(), params),
                             build_optimizer(config.optimizer, config.steps), config.seed)


# ---- trl: trainrun's step against GRPOTrainer's ------------------------------------------


def hf_dir(config: RunConfig, params: Any, path: Path) -> Path:
    from trainrun.models.huggingface import write_model_dir

    return write_model_dir(jax.device_get(params), config.model, path, model_type="llama")


def trainrun_contender(config: RunConfig, params: Any, pool: list[Prompt], count: int,
                       step: Any) -> float:
    """Seconds of steps 2 to ``count``: each draws its rollout batch from the state the last
    one left, as the run's loop does."""
    batches = rollout_batches(config, pool)
    state = fresh_state(config, params)
    marks = []
    for _ in range(count):
        batches.follow(state)
        state, metrics = step(state, next(batches))
        jax.block_until_ready(metrics)
        marks.append(time.perf_counter())
    return marks[-1] - marks[0]


def trl_contender(path: Path, asked: list[Prompt], count: int, out: Path) -> float:
    """Seconds of steps 2 to ``count`` of ``GRPOTrainer.train`` on ``asked`` in order, each
    step's prompts the next ``PROMPTS``."""
    import datasets
    import tokenizers
    import transformers
    import trl

    vocab = grpo_config().model.vocab
    # one word a token id, "<id>": TRL reads the prompts as the same ids trainrun does
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<2>",
                                                     pad_token="<0>", unk_token="<0>")
    dataset = datasets.Dataset.from_dict({
        "prompt": [" ".join(f"<{i}>" for i in p.ids) for p in asked[:count * PROMPTS]]})

    def format_regex(completions: list[str], **_: Any) -> list[float]:
        ids = [[int(word[1:-1]) for word in text.split()] for text in completions]
        texts = [bytes(i for i in row if i < 256).decode(errors="replace") for row in ids]
        return [float(re.search(VOWEL, text, re.DOTALL) is not None) for text in texts]

    args = trl.GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to=[], per_device_train_batch_size=ROWS, num_generations=GROUP,
        max_completion_length=COMPLETION, generation_kwargs={"min_new_tokens": COMPLETION},
        temperature=1.0, max_steps=count, learning_rate=1e-3,
        lr_scheduler_type="constant", adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, loss_type="dapo", shuffle_dataset=False,
        logging_steps=count, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    marks: list[float] = []

    class Timed(transformers.TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            marks.append(time.perf_counter())

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=format_regex, args=args,
                              train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[Timed()])
    trainer.train()
    return marks[-1] - marks[0]


def against_trl(rounds: int, count: int) -> None:
    import torch
    import trl

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    config = grpo_config()
    params = jax.jit(build_model(config.model).init)(jax.random.key(0))
    pool = prompts(config, count * PROMPTS)
    # the prompts of trainrun's rollout batches, in its order, for TRL's sequential one
    order = rollout_batches(config, pool)
    asked = [prompt for index in range(count) for prompt in order.batch_prompts(index)]
    step = jitted_step(config, make_grpo_transformer(config.model, config.rl))
    trainrun_contender(config, params, pool, 2, step)  # warmup: compile
    with tempfile.TemporaryDirectory() as tmp:
        path = hf_dir(config, params, Path(tmp) / "llama")
        seconds, threads = interleaved(
            rounds, lambda: trainrun_contender(config, params, pool, count, step),
            lambda out: trl_contender(path, asked, count, out), Path(tmp))
    print(f"{machine()}; torch {torch.__version__} ({threads} threads by default), "
          f"trl {trl.__version__}; {rounds} interleaved rounds of {count} steps; "
          f"{ROWS} completions of {COMPLETION} tokens a step")
    per_step = {name: [s / (count - 1) for s in values] for name, values in seconds.items()}
    ours = statistics.median(per_step["trainrun"])
    print("| contender | ms per step best / median (steps 2-last) | each round | "
          "/ trainrun (median) |\n|---|---:|---:|---:|")
    for name, values in per_step.items():
        each = " / ".join(f"{v * 1e3:.0f}" for v in values)
        print(f"| {name} | {min(values) * 1e3:.0f} / {statistics.median(values) * 1e3:.0f} | "
              f"{each} | {statistics.median(values) / ours:.2f}x |")
    print(f"TRL / trainrun (medians): {statistics.median(per_step['TRL']) / ours:.2f}x "
          "(target >= 2x)")


# ---- parts: the rollout batch, the update and a next-token step --------------------------


def next_token_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A rollout batch's rows as next-token rows: each prompt and its completion one document
    (the padding before it another), the completion's tokens the targets."""
    tokens, start = batch["tokens"], batch["start"]
    slots = np.arange(tokens.shape[1])[None]
    completion = slots >= tokens.shape[1] - COMPLETION
    return {"tokens": tokens, "segment_ids": (slots >= start[:, None]).astype(np.int32),
            "positions": np.maximum(slots - start[:, None], 0).astype(np.int32),
            "loss_mask": np.broadcast_to(completion, tokens.shape).astype(np.int32)}


def timed_calls(step: Any, state: list[TrainState], batch: Any) -> Callable[[], float]:
    def measure() -> float:
        start = time.perf_counter()
        for _ in range(10):
            state[0], metrics = step(state[0], batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / 10

    return measure


ROLLOUT = "rollout batch (generation, rewards)"


def parts(rounds: int) -> None:
    config = grpo_config()
    params = jax.jit(build_model(config.model).init)(jax.random.key(0))
    batches = rollout_batches(config, prompts(config, PROMPTS))
    batches.follow(fresh_state(config, params))
    batch = batches.draw(0)  # warmup: compile
    sft_rows = next_token_rows(batch)
    contenders: dict[str, Callable[[], float]] = {}

    def draw() -> float:
        start = time.perf_counter()
        batches.draw(0)
        return time.perf_counter() - start

    logps_args = (config.model, params, batch["tokens"], batch["start"],
                  batch["completion_mask"])
    np.asarray(completion_logps(*logps_args))  # warmup: compile

    def old_logps() -> float:
        start = time.perf_counter()
        np.asarray(completion_logps(*logps_args))
        return time.perf_counter() - start

    contenders[ROLLOUT] = draw
    contenders["old log-probs' forward pass (several updates a batch)"] = old_logps
    for name, model, rows in (("GRPO update (dapo)",
                               make_grpo_transformer(config.model, config.rl), batch),
                              ("next-token step, same rows and targets",
                               build_model(config.model), sft_rows)):
        step = jitted_step(config, model)
        state = [fresh_state(config, params)]
        placed = jax.device_put(rows)
        state[0], metrics = step(state[0], placed)  # warmup: compile
        jax.block_until_ready(metrics)
        contenders[name] = timed_calls(step, state, placed)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, measure in contenders.items():
            times[name].append(measure())
    print(f"{machine()}; {rounds} interleaved rounds; {ROWS} completions of {COMPLETION} "
          f"tokens, rows of {batch['tokens'].shape[1]} tokens")
    median = {name: statistics.median(values) for name, values in times.items()}
    drawn, update = median[ROLLOUT], median["GRPO update (dapo)"]
    print("| part | ms best / median | / step (median) |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {min(values) * 1e3:.1f} / {median[name] * 1e3:.1f} | "
              f"{median[name] / (drawn + update):.2f} |")
    print(f"the rollout batch's share of the step: {drawn / (drawn + update):.2f}")
    ratio = update / median["next-token step, same rows and targets"]
    print(f"GRPO update / next-token step: {ratio:.2f}x (target <= 1.2x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["trl", "parts"])
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    configure_process()  # as `trainrun train` does, before the first computation
    if args.what == "trl":
        against_trl(args.rounds or 3, args.steps)
    else:
        parts(args.rounds or 10)


if __name__ == "__main__":
    main()
