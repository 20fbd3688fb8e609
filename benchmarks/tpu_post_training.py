"""Post-training on one TPU chip (or, with ``--tiny``, on any backend at toy sizes: a check of
the code, not a measurement): trainrun's DPO step with LoRA at a Qwen2.5-0.5B shape, and the
GRPO rollout's decoding against a plain ``lax.scan`` decode loop written here.

    python benchmarks/tpu_post_training.py --out DIR [--tiny] [--budget-s 200]
        [--parts decode,dpo] [--dpo-batches 4,8,16] [--dpo-set KEY=VALUE ...] [--rounds 5]

The model: a Qwen2.5-0.5B shape (vocabulary 151936, 24 layers, d_model 896, 14 query and 2
key/value heads, SwiGLU 4864, RMSNorm, rotary positions with base 1e6, q/k/v biases, tied
head), random init (no weights are read), float32 params, bfloat16 compute.

``dpo``: the ``dpo`` config at that shape with LoRA (rank 16, alpha 32, every linear layer;
only the adapters train, as ``model.lora`` makes a run do), the reference computed in the step
by the same params with the adapters off (``preference.reference=in_step``), DPO's sigmoid
loss alone (``preference.nll_weight=0``), the layers under ``lax.scan`` and rematerialized
(``model.scan_layers``, ``model.remat=full``: without remat one row of 2048 tokens is the
most the chip holds). Rows of 2049 tokens hold random pairs (prompts of 128-512 tokens,
answers of 64-384) packed as trainrun packs them (``data/pair_rows.py``: a pair's prompt once,
both answers after it), stored in the dtypes trainrun's row files hold. The step is the run's:
the model ``build_model`` makes with the fast paths' choices, ``CompiledSteps``' program
(one step a call, the state donated, placed on the run's mesh), its AdamW on the adapters. The
batches of ``--dpo-batches`` go smallest first: the smallest compiles on a thread beside the
decode part; a batch whose compiled memory (``memory_analysis``) fits the device's
``bytes_limit`` less 3% is timed (rounds of one call, a blocking read, the median) and its row
written before the next batch's compile starts, which it does only where that compile (as
long as the longest seen here) and as long a timing again end within the budget; a batch
that does not fit ends the part. FLOPs three ways:

- model FLOPs (the MFU figure): per token, the policy's forward pass (2N) and its backward pass
  to the activations (2N: the frozen weights take no gradient), the adapters' own weight
  gradients (4 x adapter params), the reference's forward pass (2N), and attention's
  products (16 x layers x seq x heads x head_dim: 4 forward and 8 backward for the policy, 4
  for the reference; the causal mask not discounted); N: the weights in matmuls, the head
  once (``program/flops.py``'s N). Remat's recomputed forward is not counted;
- trainrun's own count (``CompiledSteps.flops_per_step``: XLA's cost analysis of the one-step
  program, what the run's summary reports; XLA counts a loop's body once, so with the layers
  under scan it holds one layer of 24);
- 6N (a full fine-tune's count, ``transformer_flops``), for comparison.

``decode``: GRPO's rollout generation as the run draws it (``program/rollouts.py``'s
``draw_rollouts``: ``rl.group`` completions of each of ``rl.prompts`` prompts, each
completion's own key, temperature 1, the ``grpo`` config's settings at that shape, no stop
id so every completion is drawn to its full length, the old log-probabilities skipped as one
update a batch skips them) against a plain decode loop written here: the same model maths
over the same params (``jax.nn.dot_product_attention`` over a token-major key/value cache,
``[rows, slots, kv_heads, head_dim]`` per layer; prefill, then one token a step under
``lax.scan``, sampled at the same temperature; jitted once). 8 prompts of 128 random tokens,
group 8, 256 new tokens: 64 rows. The params are drawn with ``model.init_std`` 2/sqrt(d_model),
so that attention picks out a few positions, as a trained model's does (at the usual spread
random weights attend almost evenly, and the check below would not see the positions' maths).
Decode tokens/s is rows x new tokens over the wall time of one call, its tokens read back to
the host; interleaved rounds, medians.

``check`` (with ``decode``): greedy decoding (temperature 0) of the same 8 prompts by both, in
float32 at the highest matmul precision: the completions token for token, and the plain loop
fed trainrun's tokens (teacher forcing), the gap at each step between its greatest logit and
trainrun's token's (0 wherever trainrun's token is the plain loop's greedy choice).

A markdown report on stdout and in OUT/tpu_post_training.md; every figure in
OUT/tpu_post_training.json (both written again as each part, and each DPO batch, ends).
``--budget-s`` is a deadline: a compile starts only where the longest compile seen here would
still end before it, timing rounds stop where one more would not, what is skipped is said in
a line, and at the deadline itself the report is written as it stands and the process ends.
Exit 2 where the budget left a program out, at the deadline or before it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tpu_step import PEAK_BF16, GiB, device_limit, memory_of

from trainrun.config import RunConfig, TransformerModel, load_config
from trainrun.data.pair_rows import pack_pairs
from trainrun.data.preference_pairs import Pair
from trainrun.data.preference_rows import OPEN_ROWS
from trainrun.fast import strategies
from trainrun.models import build_model
from trainrun.program import sharding
from trainrun.program.compiled import CompiledSteps
from trainrun.program.flops import transformer_flops
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.rollouts import RolloutSettings, draw_rollouts
from trainrun.program.state import abstract_state, compile_init, init_program, init_state
from trainrun.reporting.timing import Stopwatch

MEMORY_MARGIN = 0.03  # of the device's memory, left free when a batch is said to fit
SAID: list[str] = []  # every line printed, for OUT/tpu_post_training.md


def say(text: str = "") -> None:
    SAID.append(text)
    print(text, flush=True)


# ---- sizes ----------------------------------------------------------------------------------


QWEN = ("model.vocab=151936", "model.d_model=896", "model.layers=24", "model.heads=14",
        "model.kv_heads=2", "model.mlp_hidden=4864")
TINY = ("model.vocab=512", "model.d_model=64", "model.layers=2", "model.heads=4",
        "model.kv_heads=2", "model.mlp_hidden=128")
# Qwen2's layout, whatever the size
LAYOUT = ("model.mlp=swiglu", "model.norm=rmsnorm", "model.norm_eps=1e-6",
          "model.positions=rope", "model.rope_theta=1000000", "model.qkv_bias=true",
          "model.tie_embeddings=true", "model.dropout=0.0")
LORA = "model.lora={rank: 16, alpha: 32, targets: all-linear}"
DPO = ("preference.reference=in_step", "preference.nll_weight=0.0",
       "precision.compute=bfloat16", "model.scan_layers=true", "model.remat=full")
DPO_RESERVE = 20.0  # seconds a DPO compile leaves: the state's init, a first call, a round


@dataclasses.dataclass(frozen=True)
class Sizes:
    name: str
    model: tuple[str, ...]  # the model section, as config overrides
    seq: int  # a DPO row's inputs: its tokens less one
    dpo_batches: tuple[int, ...]  # rows a DPO step, each tried
    prompt: tuple[int, int]  # a pair's prompt length, lowest and highest
    answer: tuple[int, int]  # each of its answers' lengths
    prompts: int  # rollout prompts
    group: int  # completions a prompt
    prompt_len: int  # each rollout prompt's tokens
    new: int  # tokens a completion


def sizes(tiny: bool) -> Sizes:
    if tiny:
        return Sizes("tiny", TINY + LAYOUT, 128, (2, 4), (8, 32), (4, 24), 2, 2, 8, 12)
    return Sizes("Qwen2.5-0.5B shape", QWEN + LAYOUT, 2048, (4, 8, 16), (128, 512),
                 (64, 384), 8, 8, 128, 256)


# ---- the compile pool and the budget ---------------------------------------------------------


class Budget:
    """The time left (``clock``: seconds, monotonic), and a pool of threads the programs compile
    on (XLA compiles outside Python's lock: they overlap each other and the timing on the chip).
    Programs are lowered in the main thread. A compile starts only where the longest compile
    seen here would still end within what is left (``can_compile``); at the deadline itself,
    ``main``'s watchdog writes the report as it stands and ends the process."""

    def __init__(self, seconds: float, threads: int,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.deadline = clock() + seconds
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self.notes: list[str] = []
        self.compile_s: list[float] = []  # each compile's seconds, as it ends
        self.left_out = False  # whether a program was not compiled for want of time

    def left(self) -> float:
        return self.deadline - self.clock()

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"- {text}")

    def estimate(self) -> float:
        """The seconds a compile may take: the longest seen here (0 before any ended)."""
        return max(self.compile_s, default=0.0)

    def can_compile(self, name: str, reserve: float, then: float = 0.0) -> bool:
        """Whether a compile of ``name`` (``estimate``), and ``then`` seconds after it, end
        before the budget less ``reserve`` does; a note says so where not."""
        estimate, left = self.estimate(), self.left() - reserve
        if estimate + then <= left:
            return True
        self.left_out = True
        self.note(f"{name}: not compiled: a compile took {estimate:.0f} s here (then "
                  f"{then:.0f} s to time it), {max(left, 0):.0f} s are left")
        return False

    def compile(self, lowered: Any) -> concurrent.futures.Future[tuple[Any, float]]:
        def job() -> tuple[Any, float]:
            start = self.clock()
            compiled = lowered.compile()
            took = self.clock() - start
            self.compile_s.append(took)
            return compiled, took

        return self.pool.submit(job)

    def wait(self, name: str, future: concurrent.futures.Future[tuple[Any, float]] | None,
             reserve: float) -> tuple[Any, float] | None:
        """The compiled program and its compile seconds, or None (a note says why) where it
        was not started, failed or was not done while the budget, less ``reserve`` seconds,
        lasted."""
        if future is None:
            return None
        try:
            return future.result(timeout=max(self.left() - reserve, 0.0))
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.left_out = True
            self.note(f"{name}: not compiled within the time budget; skipped")
        except Exception as err:  # a program that cannot be built is reported, not fatal
            self.note(f"{name}: compile failed ({type(err).__name__}: {str(err)[:300]})")
        return None


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(contenders: dict[str, Callable[[], Any]], budget: Budget, rounds: int,
                reserve: float) -> dict[str, list[float]]:
    """Rounds of one call of each contender (each call ends in a blocking read): one, then
    more while the budget, less ``reserve``, allows one more."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for done in range(rounds):
        round_s = sum(statistics.median(t) for t in times.values() if t)
        if done >= 1 and budget.left() - reserve < round_s:
            budget.note(f"timing stopped after {done} rounds (time budget)")
            break
        for name, call in contenders.items():
            times[name].append(timed(call))
    return times


# ---- the DPO step with LoRA -----------------------------------------------------------------


def dpo_config(s: Sizes, extra: list[str]) -> RunConfig:
    return load_config("dpo", [*s.model, f"model.seq_len={s.seq}", f"data.seq_len={s.seq}",
                               LORA, *DPO, *extra])


def pair_rows(s: Sizes, rows: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``rows`` rows of random pairs packed as trainrun packs them, in the dtypes of its row
    files (``data/preference_rows.py``)."""
    rng = np.random.default_rng(seed)

    def ids(bounds: tuple[int, int]) -> np.ndarray:
        return rng.integers(3, vocab, rng.integers(bounds[0], bounds[1] + 1)).astype(np.uint32)

    row_len = s.seq + 1
    per_row = max(1, row_len // (sum(s.prompt) // 2 + sum(s.answer) + 1))
    pairs = [Pair(ids(s.prompt), ids(s.answer), ids(s.answer))
             for _ in range((rows + OPEN_ROWS + 2) * (per_row + 1))]
    arrays, _ = pack_pairs(pairs, row_len, OPEN_ROWS)
    index = np.uint16 if row_len <= 2**16 else np.uint32
    dtypes = {"tokens": np.uint16 if vocab <= 2**16 else np.uint32, "segment_ids": index,
              "positions": index, "pair_slot": index, "branch": np.uint8, "answer": np.uint8}
    return {name: np.ascontiguousarray(arrays[name][:rows], dtypes[name]) for name in dtypes}


def adapter_params(cfg: TransformerModel) -> int:
    """The adapters' params (every layer's ``A`` and ``B``)."""
    assert cfg.lora is not None
    d, head_dim = cfg.d_model, cfg.attention_head_dim
    inner, kv_inner = cfg.heads * head_dim, cfg.kv_key_heads * head_dim
    sides = {"q": d + inner, "k": d + kv_inner, "v": d + kv_inner, "o": inner + d,
             "gate": d + cfg.hidden, "up": d + cfg.hidden, "down": cfg.hidden + d}
    return cfg.layers * cfg.lora.rank * sum(sides[t] for t in cfg.adapted)


def dpo_model_flops(cfg: TransformerModel, rows: int, seq: int, in_step: bool) -> float:
    """The model FLOPs of one DPO step with LoRA (module docstring): the policy's forward
    pass, its backward pass to the activations, the adapters' weight gradients, the
    reference's forward pass where the step computes it."""
    d, head_dim = cfg.d_model, cfg.attention_head_dim
    inner, kv_inner = cfg.heads * head_dim, cfg.kv_key_heads * head_dim
    weights = cfg.vocab * d + cfg.layers * (2 * d * inner + 2 * d * kv_inner
                                            + (3 if cfg.gated else 2) * d * cfg.hidden)
    adapters = adapter_params(cfg)
    attention = 4 * cfg.layers * seq * inner  # QK^T and AV of one forward pass, per token
    forward = 2 * weights + 2 * adapters + attention
    backward = 2 * weights + 4 * adapters + 2 * attention
    return float(rows * seq * (forward + backward + (forward if in_step else 0)))


@dataclasses.dataclass
class DpoSide:
    """One batch of the DPO step: its rows, the run's programs for it, the lowered program."""

    batch: int
    rows: dict[str, np.ndarray]
    programs: CompiledSteps
    placement: Any
    lowered: Any = None
    future: concurrent.futures.Future[tuple[Any, float]] | None = None
    compiled: Any = None
    compile_s: float = math.nan
    lower_s: float = math.nan


class Dpo:
    """The run's parts for the DPO step, as ``training/setup.py`` builds them."""

    def __init__(self, s: Sizes, extra: list[str]):
        self.s, self.extra = s, list(extra)
        self.config = dpo_config(s, extra)
        cfg = self.config
        chosen = strategies.chosen()
        assert isinstance(cfg.model, TransformerModel) and cfg.preference is not None
        self.cfg: TransformerModel = cfg.model
        self.model = build_model(cfg.model, cfg.preference, chosen.attention(),
                                 chosen.head_loss())
        self.optimizer = build_optimizer(cfg.optimizer, cfg.steps)
        self.policy = policy_from_config(cfg.precision)
        self.abstract = abstract_state(self.model, self.optimizer, cfg.seed, self.policy)
        self.mesh = sharding.build_mesh(cfg.mesh)
        self.state_sharding = sharding.state_shardings(
            self.mesh, self.abstract, self.model.logical_axes, self.optimizer.tx, cfg.mesh)
        self.carrier = chosen.state_carrier(self.abstract)
        self.keep = chosen.nonfinite_guard(1)
        leaves = jax.tree_util.tree_leaves_with_path(self.abstract.params)
        self.params = sum(math.prod(x.shape) for _, x in leaves)
        self.trainable = sum(math.prod(x.shape) for path, x in leaves
                             if "_lora" in jax.tree_util.keystr(path))
        self.carried: Any = None
        self.init: Any = None  # the init program, compiled

    def side(self, batch: int) -> DpoSide:
        """The run's programs for ``batch`` rows, lowered here (the main thread)."""
        placement = sharding.batch_placement(self.mesh, batch, stacked=False)
        programs = CompiledSteps(self.model, self.optimizer, 1, Stopwatch(),
                                 abstract=self.abstract, policy=self.policy,
                                 state_sharding=self.state_sharding,
                                 batch_sharding=placement.sharding, carrier=self.carrier,
                                 keep=self.keep)
        rows = pair_rows(self.s, batch, self.cfg.vocab)
        side = DpoSide(batch, rows, programs, placement)
        shapes = {name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in rows.items()}
        start = time.perf_counter()
        side.lowered = programs.fn.lower(programs.carried_shapes(), shapes)
        side.lower_s = time.perf_counter() - start
        return side

    def fresh(self) -> None:
        """The run's fresh state (``init_state``, where the run's shardings put it), its
        program compiled once."""
        self.drop()
        if self.init is None:
            self.init = compile_init(init_program(self.model, self.optimizer, self.config.seed,
                                                  self.policy, self.state_sharding))
        state = init_state(self.model, self.optimizer, self.config.seed, self.policy,
                           self.state_sharding, self.init)
        self.carried = self.carrier.carry(state)

    def drop(self) -> None:
        for leaf in jax.tree.leaves(self.carried):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        self.carried = None

    def step(self, side: DpoSide, batch: Any) -> dict[str, float]:
        """One call of the step on the shared state; its metrics."""
        self.carried, packed = side.compiled(self.carried, batch)
        values = np.asarray(packed, np.float32)  # a blocking read
        return dict(zip(side.programs.metric_names, values.tolist(), strict=True))


def queue_dpo(dpo: Dpo, batch: int, budget: Budget, reserve: float,
              then: float = 0.0) -> DpoSide | None:
    """The side of ``batch`` rows, lowered and its compile started; None (a note says why)
    where that compile and ``then`` seconds after it would not end in the budget."""
    if not budget.can_compile(f"DPO @{batch} rows", reserve, then):
        return None
    side = dpo.side(batch)
    side.future = budget.compile(side.lowered)
    return side


def compiled_fitting(side: DpoSide, budget: Budget, limit: float | None, reserve: float,
                     needs: dict[int, float]) -> bool:
    """Whether ``side`` compiled within the budget and its compiled memory fits ``limit``
    less the margin (any where the device gives no limit); a note says why not. ``needs``
    gets its need in bytes."""
    got = budget.wait(f"DPO @{side.batch} rows", side.future, reserve)
    side.lowered = side.future = None  # its text is large
    if got is None:
        return False
    side.compiled, side.compile_s = got
    side.programs.programs[1] = side.compiled  # the run's program for calls of one step
    need = needs[side.batch] = memory_of(side.compiled).get("need", math.nan)
    if limit is not None and need > limit * (1 - MEMORY_MARGIN):
        budget.note(f"DPO @{side.batch} rows: needs {need / GiB:.2f} GiB of "
                    f"{limit / GiB:.2f}; not run")
        side.compiled = None
        return False
    return True


def timed_side(dpo: Dpo, side: DpoSide, budget: Budget, rounds: int,
               reserve: float) -> dict[str, Any] | None:
    """``side``'s row: its first call on the run's fresh state, then rounds of one call while
    the budget lasts; None where the first call fails (a note says why)."""
    dpo.fresh()
    placed = jax.device_put(side.rows, side.placement.sharding)
    try:
        first = dpo.step(side, placed)
    except Exception as err:  # RESOURCE_EXHAUSTED and the like: reported, not fatal
        text = str(err).strip().splitlines() or [""]
        budget.note(f"DPO @{side.batch} rows: failed at its first call "
                    f"({type(err).__name__}: {text[0][:300]})")
        dpo.drop()  # the state it was given is donated
        return None
    name = f"{side.batch} rows"
    times = interleaved({name: lambda: dpo.step(side, placed)}, budget, rounds, reserve)
    return dpo_row(dpo, side, times[name], first)


def run_dpo(dpo: Dpo, first: DpoSide | None, budget: Budget, report: Report,
            rounds: int) -> None:
    """Each batch of the DPO step, smallest first: compiled (the first is compiling already),
    then, where it fits, timed and its row written; the next compile starts after that, and
    only where it and as long a timing again would end within the budget."""
    s, cfg = dpo.s, dpo.cfg
    say(f"\n## DPO with LoRA: {s.name}, rows of {s.seq + 1} tokens\n")
    say(f"{dpo.params:,} params, {dpo.trainable:,} of them the adapters' (rank "
        f"{cfg.lora.rank if cfg.lora else 0}, {', '.join(sorted(cfg.adapted))}); config `dpo` "
        f"with {', '.join(f'`{x}`' for x in (LORA, *DPO, *dpo.extra))}\n")
    limit = device_limit()
    needs: dict[int, float] = {}
    rows: list[dict[str, Any]] = []
    report.data["dpo"] = {
        "config": [LORA, *DPO, *dpo.extra], "params": dpo.params,
        "trainable": dpo.trainable, "limit_gib": None if limit is None else limit / GiB,
        "needs_gib": {}, "rows": rows}
    timing_s = 0.0  # the last batch's first call and rounds
    for batch in sorted(s.dpo_batches):
        side = (first if first is not None and first.batch == batch else
                queue_dpo(dpo, batch, budget, DPO_RESERVE, then=timing_s))
        if side is None:
            break
        fits = compiled_fitting(side, budget, limit, DPO_RESERVE, needs)
        report.data["dpo"]["needs_gib"] = {b: n / GiB for b, n in sorted(needs.items())}
        started = budget.clock()
        row = timed_side(dpo, side, budget, rounds, reserve=5) if fits else None
        side.compiled = None
        if row is None:  # out of time or memory: a larger batch fares no better
            break
        timing_s = budget.clock() - started
        rows.append(row)
        dpo_table(rows[-1:], header=len(rows) == 1)
        report.save()  # each row written before the next compile starts
    dpo.drop()
    said = "no limit known" if limit is None else f"of {limit / GiB:.2f} less 3%"
    say("\ncompiled memory need by rows (GiB, " + said + "): "
        + (", ".join(f"{b}: {n / GiB:.2f}" for b, n in sorted(needs.items())) or "none")
        + f"; timed: {', '.join(str(r['batch']) for r in rows) or 'none'}")
    if rows:
        dpo_flops(rows[0])
    else:
        budget.note("DPO: no batch compiled and fitting; nothing timed")
    report.save()


def dpo_row(dpo: Dpo, side: DpoSide, times: list[float], first: dict[str, float]
            ) -> dict[str, Any]:
    s, cfg = dpo.s, dpo.cfg
    step_s = statistics.median(times)
    tokens = side.batch * s.seq
    real = int(np.count_nonzero(side.rows["segment_ids"][:, :-1]))
    pairs = int(sum(side.rows["pair_slot"].max(axis=1)))
    preference = dpo.config.preference
    model = dpo_model_flops(cfg, side.batch, s.seq,
                            preference is not None and preference.reference == "in_step")
    counted, source = side.programs.flops_per_step(side.rows, cfg, side.batch)
    full = transformer_flops(cfg, side.batch, s.seq)
    return {
        "batch": side.batch, "row_tokens": s.seq + 1, "pairs": pairs,
        "pairs_metric": first.get("pairs"), "tokens": tokens, "real_tokens": real,
        "step_ms": step_s * 1e3, "step_ms_all": [t * 1e3 for t in times],
        "rounds": len(times), "tokens_per_s": tokens / step_s,
        "real_tokens_per_s": real / step_s, "pairs_per_s": pairs / step_s,
        "flops_model": model, "flops_trainrun": counted, "flops_trainrun_source": source,
        "flops_6n": full, "mfu_model": model / step_s / PEAK_BF16,
        "mfu_trainrun": counted / step_s / PEAK_BF16 if counted else None,
        "mfu_6n": full / step_s / PEAK_BF16, "compile_s": side.compile_s,
        "lower_s": side.lower_s, "memory": memory_of(side.compiled),
        "first_loss": first.get("loss"), "first_metrics": first,
    }


def dpo_table(rows: list[dict[str, Any]], header: bool = True) -> None:
    if header:
        say("| rows x tokens | pairs | ms/step | tokens/s (rows; non-padding) | pairs/s | MFU, "
            "model FLOPs | MFU, trainrun's count (XLA) | MFU, 6N | compile s | compiled GiB "
            "(temp / need) | loss, first call | rounds |")
        say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mem = r["memory"]
        gib = f"{mem['temp'] / GiB:.2f} / {mem['need'] / GiB:.2f}" if mem else "n/a"
        ours = f"{r['mfu_trainrun']:.1%}" if r["mfu_trainrun"] is not None else "n/a"
        say(f"| {r['batch']} x {r['row_tokens']} | {r['pairs']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f}; {r['real_tokens_per_s']:,.0f} | "
            f"{r['pairs_per_s']:,.1f} | {r['mfu_model']:.1%} | {ours} | {r['mfu_6n']:.1%} | "
            f"{r['compile_s']:.0f} | {gib} | {r['first_loss']:.4f} | {r['rounds']} |")


def dpo_flops(r: dict[str, Any]) -> None:
    counted = (f"{r['flops_trainrun'] / 1e12:.4g} T ({r['flops_trainrun_source']}; "
               f"{r['flops_trainrun'] / r['flops_model']:.2f} of the model FLOPs)"
               if r["flops_trainrun"] else "none")
    say(f"\nMFU against {PEAK_BF16 / 1e12:.0f} TFLOP/s (v5e's datasheet). FLOPs a step at "
        f"{r['batch']} rows: model {r['flops_model'] / 1e12:.4g} T, trainrun's count {counted}, "
        f"6N {r['flops_6n'] / 1e12:.4g} T. The first call's loss is ln 2 = 0.6931 give or take "
        "rounding: fresh adapters leave the policy the reference.")


# ---- decoding: trainrun's rollouts and a plain lax.scan loop -------------------------------


def grpo_config(s: Sizes) -> RunConfig:
    """The ``grpo`` config at the decode part's shape, its init spread ``SHARP / sqrt(d_model)``
    (module docstring)."""
    window = s.prompt_len + s.new
    settings = [*s.model, f"model.seq_len={window}", f"data.seq_len={window}",
                f"rl.group={s.group}", f"rl.prompts={s.prompts}", f"rl.completion_tokens={s.new}",
                "precision.compute=bfloat16"]
    model = load_config("grpo", settings).model
    assert isinstance(model, TransformerModel)
    return load_config("grpo", [*settings,
                                f"model.init_std={SHARP / math.sqrt(model.d_model):.4g}"])


# attention logits of spread SHARP**2: query and key entries of spread SHARP at init_std
# SHARP / sqrt(d_model)
SHARP = 2.0


def rms_norm(x: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to ``x``'s dtype (as Flax computes it)."""
    x32 = x.astype(jnp.float32)
    mul = jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)
    return (x32 * (mul * p["scale"].astype(jnp.float32))).astype(x.dtype)


def linear(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def plain_decoder(cfg: TransformerModel, rows: int, width: int, new: int, compute: str,
                  check: bool) -> Callable[..., Any]:
    """A plain decode loop of the model ``cfg`` describes over trainrun's params: the prompts
    (``[rows, width]``, no padding) through the layers once, writing a key/value cache of
    ``[rows, width + new, kv_heads, head_dim]`` per layer, then one token a step under
    ``lax.scan``, each attending to the cache's slots up to its own.

    ``check`` False: ``(params, prompts, key, temperature) -> tokens [rows, new]``, sampled
    (token ``i`` from ``fold_in(key, i)``). ``check`` True: ``(params, prompts, forced,
    use_forced) -> (tokens, gaps)``, greedy, or fed ``forced`` where ``use_forced``; ``gaps``
    ``[rows, new]``: the greatest logit less the chosen token's."""
    dtype = jnp.dtype(compute)
    heads, kv_heads, head_dim = cfg.heads, cfg.kv_key_heads, cfg.attention_head_dim
    half = head_dim // 2
    freqs = (1.0 / cfg.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                      / np.float32(head_dim))).astype(np.float32)
    window = width + new

    def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(freqs)
        sin, cos = (f(angles).astype(x.dtype)[:, None, :] for f in (jnp.sin, jnp.cos))
        a, b = x[..., :half], x[..., half:]
        return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def block(x: jax.Array, p: Any, kv: tuple[jax.Array, jax.Array], pos: Any
              ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        chunk = x.shape[1]
        h = rms_norm(x, p["ln1"], cfg.norm_eps)
        att = p["attn"]
        q = linear(h, att["q"]).reshape(rows, chunk, heads, head_dim)
        k = linear(h, att["k"]).reshape(rows, chunk, kv_heads, head_dim)
        v = linear(h, att["v"]).reshape(rows, chunk, kv_heads, head_dim)
        positions = pos + jnp.arange(chunk)
        q, k = rope(q, positions), rope(k, positions)
        kv = tuple(jax.lax.dynamic_update_slice(c, t, (0, pos, 0, 0))
                   for c, t in zip(kv, (k, v), strict=True))
        if chunk > 1:  # the prompt: causal attention within it
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            seen = jnp.full((rows,), pos + 1, jnp.int32)
            o = jax.nn.dot_product_attention(q, *kv, key_value_seq_lengths=seen)
        x = x + linear(o.reshape(rows, chunk, heads * head_dim), att["o"])
        h = rms_norm(x, p["ln2"], cfg.norm_eps)
        mlp = p["mlp"]
        x = x + linear(jax.nn.silu(linear(h, mlp["gate"])) * linear(h, mlp["up"]), mlp["down"])
        return x, kv  # type: ignore[return-value]

    def forward(p: Any, ids: jax.Array, cache: list[Any], pos: Any) -> tuple[jax.Array, list]:
        table = p["embed"]["embedding"]
        x = jnp.take(table, ids, axis=0)
        new_cache = []
        for i in range(cfg.layers):
            x, kv = block(x, p["blocks"][str(i)], cache[i], pos)
            new_cache.append(kv)
        last = rms_norm(x[:, -1], p["ln_f"], cfg.norm_eps)
        logits = jax.lax.dot_general(last, table, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
        return logits, new_cache

    def decode(params: Any, prompts: jax.Array, pick: Callable[..., Any]) -> Any:
        p = jax.tree.map(lambda x: x.astype(dtype), params)
        shape = (rows, window, kv_heads, head_dim)
        cache = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.layers)]
        logits, cache = forward(p, prompts, cache, 0)

        def step(carry: Any, i: jax.Array) -> Any:
            cache, logits = carry
            token, out = pick(logits, i)
            logits, cache = forward(p, token[:, None], cache, width + i)
            return (cache, logits), out

        _, out = jax.lax.scan(step, (cache, logits), jnp.arange(new))
        return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), out)

    def sampled(params: Any, prompts: jax.Array, key: jax.Array,
                temperature: jax.Array) -> jax.Array:
        def pick(logits: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
            token = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
            return token, token

        return decode(params, prompts, pick)

    def greedy(params: Any, prompts: jax.Array, forced: jax.Array,
               use_forced: jax.Array) -> tuple[jax.Array, jax.Array]:
        def pick(logits: jax.Array, i: jax.Array) -> tuple[jax.Array, Any]:
            token = jnp.where(use_forced, forced[:, i], jnp.argmax(logits, axis=-1))
            gap = jnp.max(logits, -1) - jnp.take_along_axis(logits, token[:, None], -1)[:, 0]
            return token, (token, gap)

        return decode(params, prompts, pick)

    return jax.jit(greedy if check else sampled)


@dataclasses.dataclass
class Decode:
    """The GRPO run's model and rollout settings at the decode part's shape, the plain
    loop's programs queued, the prompts."""

    s: Sizes
    config: RunConfig
    cfg: TransformerModel
    prompts: np.ndarray
    sampled: concurrent.futures.Future[tuple[Any, float]] | None
    check: concurrent.futures.Future[tuple[Any, float]] | None


def queue_decode(s: Sizes, budget: Budget, check: bool, reserve: float) -> Decode:
    config = grpo_config(s)
    assert isinstance(config.model, TransformerModel)
    cfg = config.model
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    prompts = np.random.default_rng(1).integers(3, cfg.vocab, (s.prompts, s.prompt_len),
                                                dtype=np.int32)
    rows = s.prompts * s.group
    lowered = plain_decoder(cfg, rows, s.prompt_len, s.new, config.precision.compute,
                            False).lower(shapes,
                                         jax.ShapeDtypeStruct((rows, s.prompt_len), jnp.int32),
                                         jax.random.key(0), np.float32(1.0))
    sampled = budget.compile(lowered) if budget.can_compile("plain decode loop", reserve) else None
    queued = None
    if check and budget.can_compile("plain decode loop, greedy check", reserve):
        with jax.default_matmul_precision("highest"):
            lowered = plain_decoder(cfg, s.prompts, s.prompt_len, s.new, "float32", True).lower(
                shapes, prompts, np.zeros((s.prompts, s.new), np.int32), np.bool_(False))
        queued = budget.compile(lowered)
    return Decode(s, config, cfg, prompts, sampled, queued)


def run_decode(d: Decode, budget: Budget, report: Report, rounds: int, reserve: float) -> None:
    s, cfg = d.s, d.cfg
    assert d.config.rl is not None
    rows = s.prompts * s.group
    say(f"\n## GRPO rollouts: {s.name}, {s.prompts} prompts x group {s.group} = {rows} rows, "
        f"prompts of {s.prompt_len} tokens, {s.new} new tokens, temperature "
        f"{d.config.rl.temperature:g}, {d.config.precision.compute}, init std "
        f"{cfg.init_std:g}\n")
    params = jax.jit(build_model(cfg).init)(jax.random.key(0))
    try:
        compare_decoders(d, params, budget, report, rounds, reserve)
        if d.check is not None:
            greedy_check(d, params, budget, report, reserve)
    finally:  # the chip's memory for the DPO part
        for leaf in jax.tree.leaves(params):
            leaf.delete()


def compare_decoders(d: Decode, params: Any, budget: Budget, report: Report, rounds: int,
                     reserve: float) -> None:
    """trainrun's rollouts against the plain loop, sampled, in interleaved rounds."""
    s, cfg = d.s, d.cfg
    assert d.config.rl is not None
    rows = s.prompts * s.group
    key = jax.random.key(d.config.seed)
    settings = RolloutSettings(group=s.group, tokens=s.new, temperature=d.config.rl.temperature,
                               top_p=d.config.rl.top_p, compute=d.config.precision.compute)
    asked = list(d.prompts)
    draws = iter(range(1_000_000))  # each call a new step: the run draws anew each step

    def ours() -> np.ndarray:
        drawn = draw_rollouts(cfg, params, asked, key, next(draws), settings, None,
                              width=s.prompt_len, old_logps=False)
        return np.asarray(drawn.completions)

    if not budget.can_compile("trainrun's rollouts", reserve):
        return
    start = time.perf_counter()
    drawn = ours()  # its decoder compiles at the first call, as in a run
    first_s = time.perf_counter() - start
    budget.compile_s.append(first_s)  # its compile's seconds, at most
    got = budget.wait("plain decode loop", d.sampled, reserve)
    if got is None:
        return
    plain, plain_compile = got
    plain_prompts = jax.device_put(np.repeat(d.prompts, s.group, axis=0))  # as the run's rows
    temperature = np.float32(d.config.rl.temperature)

    def theirs() -> np.ndarray:
        return np.asarray(plain(params, plain_prompts, jax.random.key(next(draws)), temperature))

    start = time.perf_counter()
    assert drawn.shape == theirs().shape == (rows, s.new)
    plain_first = time.perf_counter() - start
    times = interleaved({"trainrun": ours, "plain": theirs}, budget, rounds, reserve)
    results = []
    for name, what, first, compile_s in (
            ("trainrun", "draw_rollouts (program/rollouts.py, decode.py's decoder: "
             "head-major cache, lax.while_loop)", first_s, None),
            ("plain", "lax.scan loop written here (token-major cache, "
             "jax.nn.dot_product_attention)", plain_first, plain_compile)):
        median = statistics.median(times[name])
        results.append({"name": name, "what": what, "rows": rows, "new": s.new,
                        "call_s": median, "call_s_all": times[name],
                        "tokens_per_s": rows * s.new / median,
                        "ms_per_token_step": median / s.new * 1e3,
                        "first_call_s": first, "compile_s": compile_s,
                        "rounds": len(times[name])})
    ratio = results[0]["tokens_per_s"] / results[1]["tokens_per_s"]
    report.data["decode"] = {"rows": results, "trainrun_over_plain": ratio,
                             "shape": dataclasses.asdict(s)}
    say("| contender | rows x new tokens | s a call | decode tokens/s | ms a token step | "
        "first call s (compile included) |")
    say("|---|---|---:|---:|---:|---:|")
    for r in results:
        compiled = f" (compile {r['compile_s']:.1f} s apart)" if r["compile_s"] else ""
        say(f"| {r['name']}: {r['what']} | {r['rows']} x {r['new']} | {r['call_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['ms_per_token_step']:.2f} | "
            f"{r['first_call_s']:.1f}{compiled} |")
    say(f"\ntrainrun's decode tokens/s / the plain loop's: {ratio:.2f}x (medians of "
        f"{results[0]['rounds']} interleaved rounds)")
    report.save()


def greedy_check(d: Decode, params: Any, budget: Budget, report: Report,
                 reserve: float) -> None:
    """Greedy decoding of the same prompts by both in float32 (module docstring)."""
    assert d.check is not None
    s, cfg = d.s, d.cfg
    settings = RolloutSettings(group=1, tokens=s.new, temperature=0.0, compute="float32")
    if not budget.can_compile("trainrun's greedy rollouts", reserve):
        return
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(draw_rollouts(cfg, params, list(d.prompts), jax.random.key(0), 0,
                                        settings, None, width=s.prompt_len,
                                        old_logps=False).completions)
    got = budget.wait("plain decode loop, greedy check", d.check, reserve)
    if got is None:
        return
    check, _ = got
    free, _ = (np.asarray(x) for x in check(params, d.prompts, np.zeros_like(ours),
                                            np.bool_(False)))
    forced, gaps = (np.asarray(x) for x in check(params, d.prompts, ours, np.bool_(True)))
    assert np.array_equal(forced, ours)
    same = [bool(np.array_equal(a, b)) for a, b in zip(free, ours, strict=True)]
    parted = [int(np.argmax(a != b)) for a, b, equal in zip(free, ours, same, strict=True)
              if not equal]
    found = {"rows": len(same), "rows_equal": sum(same), "same_tokens": all(same),
             "first_difference_at": parted, "forced_max_gap": float(gaps.max()),
             "forced_steps_not_greedy": int(np.count_nonzero(gaps > 0)),
             "steps": int(gaps.size)}
    report.data["greedy_check"] = found
    say(f"\nGreedy check (float32, highest matmul precision, {len(same)} prompts x {s.new} "
        f"tokens): {found['rows_equal']} of {len(same)} completions equal token for token"
        + (f" (the others part at tokens {parted})" if parted else "")
        + f"; the plain loop fed trainrun's tokens: {found['forced_steps_not_greedy']} of "
        f"{found['steps']} steps where trainrun's token is not its greatest logit, the largest "
        f"gap {found['forced_max_gap']:.2e}")
    report.save()


# ---- the report and main --------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    out: Path
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "tpu_post_training.json").write_text(
            json.dumps(self.data, indent=1, default=str))
        (self.out / "tpu_post_training.md").write_text("\n".join(SAID) + "\n")


def run_parts(args: argparse.Namespace, budget: Budget, report: Report) -> None:
    s = sizes(args.tiny)
    if args.dpo_batches:
        s = dataclasses.replace(s, dpo_batches=tuple(int(b) for b in args.dpo_batches.split(",")))
    parts = set(args.parts.split(","))
    device = jax.devices()[0]
    say(f"# Post-training on {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}: {s.name}\n")
    if jax.default_backend() != "tpu":
        say("Not a TPU: the figures check the code, they measure nothing.")
    report.data.update(device=device.device_kind, backend=jax.default_backend(),
                       jax=jax.__version__, sizes=dataclasses.asdict(s), parts=sorted(parts))
    report.save()
    dpo = first = None
    if "dpo" in parts:  # the smallest batch's compile first: beside the decode part
        dpo = Dpo(s, args.dpo_set)
        first = queue_dpo(dpo, min(s.dpo_batches), budget, DPO_RESERVE)
    reserve = 3 * DPO_RESERVE if dpo else 5  # what the decode part leaves the DPO part
    if "decode" in parts:
        decode = queue_decode(s, budget, "check" in parts, reserve)
        run_decode(decode, budget, report, args.rounds, reserve)
    if dpo is not None:
        run_dpo(dpo, first, budget, report, args.rounds)


def out_of_time(budget: Budget, report: Report) -> None:
    """At the deadline: the report as it stands written, the process ended (a compile or a
    call under way is not waited for)."""
    budget.notes.append("the time budget ran out: stopped there; what was measured is above")
    SAID.append(f"- {budget.notes[-1]}")
    try:
        report.data["notes"] = budget.notes
        report.save()
    finally:
        print(SAID[-1], flush=True)
        os._exit(2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="tpu-post-training-"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile-threads", type=int, default=6)
    parser.add_argument("--parts", default="decode,check,dpo")
    parser.add_argument("--dpo-batches", default="", help="rows a DPO step, each tried "
                        "(default: 4,8,16; --tiny 2,4)")
    parser.add_argument("--dpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of the DPO run (model.remat=none, ...)")
    args = parser.parse_args()
    budget = Budget(args.budget_s, args.compile_threads)
    report = Report(Path(args.out))
    started = time.monotonic()
    watchdog = threading.Timer(args.budget_s, out_of_time, (budget, report))
    watchdog.daemon = True
    watchdog.start()
    code = 0
    try:
        run_parts(args, budget, report)
    except Exception:  # whatever was measured is still written
        budget.note("stopped by an error: " + traceback.format_exc()[-2000:])
        code = 1
    if code == 0 and budget.left_out:  # ended before the deadline, yet short of the budget
        code = 2
        budget.note("the time budget ran out: what it left out is said above")
    report.data["notes"] = budget.notes
    report.data["wall_s"] = time.monotonic() - started
    report.save()
    say(f"\nwall {report.data['wall_s']:.0f} s; JSON: {report.out / 'tpu_post_training.json'}")
    sys.stdout.flush()
    # compiles still running (programs skipped for time) are not waited for
    os._exit(code)


if __name__ == "__main__":
    main()
