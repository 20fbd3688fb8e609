"""FLOPs of one training step: XLA's cost analysis of the compiled one-step program (per
device, times the devices it runs on), or, where XLA gives no count (some backends answer
nothing), the model's analytic count (``analytic_flops``). ``reporting/mfu.py`` measures them
against the hardware's peak."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from trainrun.config import CNNModel, MLPModel, ModelConfig, NNXMLPModel, TransformerModel
from trainrun.storage import kept_figures

XLA = "xla_cost_analysis"  # flops_source of a count from XLA


# ---- FLOPs of a compiled program -------------------------------------------------------------


def xla_flops(stage: Any) -> float | None:
    """FLOPs in XLA's cost analysis of a lowered or compiled program; None where it gives none
    (an empty answer, a count of 0, or a backend that does not implement it)."""
    try:
        cost = stage.cost_analysis()
    except Exception:  # not implemented on some backends: a missing count must not fail a run
        return None
    if isinstance(cost, (list, tuple)):  # one dict per partition in some jax versions
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def program_flops(compiled: Any) -> float | None:
    """FLOPs of one execution of a compiled program, over all devices it runs on.

    XLA's cost analysis counts the partitioned (per-device) module, so it is multiplied by the
    program's device count. It counts a while loop's body once: pass a one-step program, not a
    K-step ``lax.scan``.
    """
    flops = xla_flops(compiled)
    if flops is None:
        return None
    shardings = [s for s in jax.tree.leaves(compiled.input_shardings) if s is not None]
    devices = len(shardings[0].device_set) if shardings else 1
    return flops * devices


def program_text(lowered: Any) -> bytes:
    """A lowered program's StableHLO text without its source locations (which name the frames
    that traced it, down to how the process started): what a figure derived from it is kept
    under (``kept_figures``)."""
    return lowered.as_text(debug_info=False).encode()


def step_flops(programs: dict[int, Any], one_step: Callable[..., Any], state: Any,
               batch: Any, texts: Sequence[bytes] = ()) -> float | None:
    """FLOPs of one training step of a run, by XLA's cost analysis.

    programs: the run's compiled calls by steps per call. The one-step program's count is used
        when there is one; otherwise ``one_step`` is lowered on the shapes of ``state`` and one
        step's slice of the stacked ``batch`` (unpartitioned: the count is already global), as
        a K-step scan's count holds its body once. texts: the compiled calls' programs
        (``program_text``), which hold the step: with them, the count is kept for a later
        process running the same programs, and read back instead of tracing the step again.
    """
    if 1 in programs:
        return program_flops(programs[1])

    def shapes(tree: Any, drop: int) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[drop:], x.dtype), tree)

    key = None
    if texts:
        leaves = [(x.shape, str(x.dtype)) for x in jax.tree.leaves((state, batch))]
        key = kept_figures.figure_key("step-flops", *texts, repr(leaves))
        kept = kept_figures.recall(key)
        if kept is not None:
            return kept[0]
    flops = xla_flops(jax.jit(one_step).lower(shapes(state, 0), shapes(batch, 1)))
    if key is not None:
        kept_figures.keep(key, flops)
    return flops


def flops_per_step(programs: dict[int, Any], one_step: Callable[..., Any], state: Any,
                   batch: Any, model: ModelConfig | None, examples: int,
                   texts: Sequence[bytes] = ()) -> tuple[float | None, str | None]:
    """FLOPs of one training step and where the figure comes from: XLA's cost analysis where it
    gives a count (``XLA``), else the model's analytic count (``analytic_flops``).

    model: the config section the run built its model from; None for a model passed in, which
        has no analytic count. examples: sequences or examples per step (the global batch).
        texts: as ``step_flops`` takes them.
    """
    flops = step_flops(programs, one_step, state, batch, texts)
    if flops is not None:
        return flops, XLA
    tokens = batch.get("tokens") if isinstance(batch, dict) else None
    seq_len = tokens.shape[-1] - 1 if tokens is not None else None  # the last is a target only
    counted = analytic_flops(model, examples, seq_len)
    return counted if counted is not None else (None, None)


# ---- the model's analytic count --------------------------------------------------------------
#
# Training FLOPs = 3 x forward (the backward pass computes two products per forward one: the
# gradient of the activations and of the weights), and a forward multiply-add is 2 FLOPs: hence
# 6 per multiply-add. Only matmuls and convs are counted: norms, activations, biases, the loss
# and the optimizer's update are a few FLOPs per element, small beside them at these widths.


def transformer_flops(cfg: TransformerModel, examples: int, seq_len: int | None = None) -> float:
    """Training FLOPs of one step of the transformer on ``examples`` sequences of ``seq_len``
    input tokens (default: its context, ``cfg.seq_len``).

        6 x N x tokens + 12 x layers x seq_len x (heads x head_dim) x tokens

    N: the weights that take part in matmuls: per layer q and o (d_model x heads x head_dim
    each), k and v (d_model x kv_heads x head_dim each: fewer with grouped-query attention),
    the MLP's two matrices (three for SwiGLU) of d_model x its width; and the output head once
    (vocab x d_model, tied or not: the input lookup is a gather, not a matmul). Attention: QK^T
    and AV are each 2 x seq_len x heads x head_dim FLOPs per token and layer forward, x3 with
    the backward. The causal mask is not discounted (as in ``benchmarks/gpu_lm.sh`` and PaLM's
    count): this is the dense attention's work, of which a kernel that skips masked blocks
    does a little over half.
    """
    seq = seq_len or cfg.seq_len
    tokens = examples * seq
    d, inner = cfg.d_model, cfg.heads * cfg.attention_head_dim
    kv_inner = cfg.kv_key_heads * cfg.attention_head_dim
    mlp = (3 if cfg.gated else 2) * d * cfg.hidden
    matmul_weights = cfg.vocab * d + cfg.layers * (2 * d * inner + 2 * d * kv_inner + mlp)
    return float(6 * matmul_weights * tokens + 12 * cfg.layers * seq * inner * tokens)


def dense_flops(sizes: list[int], examples: int) -> float:
    """Training FLOPs of one step of an MLP with layer widths ``sizes``: 6 x weights x examples
    (each weight is one multiply-add per example; biases are left out, and the first layer's
    input gradient, which nothing needs, is counted, as in the usual 6 x N)."""
    return float(6 * sum(a * b for a, b in itertools.pairwise(sizes)) * examples)


def cnn_flops(cfg: CNNModel, examples: int) -> float:
    """Training FLOPs of one step of the CNN: 6 x multiply-adds per example x examples.

    A 3x3 "SAME" conv does 9 x c_in x c_out multiply-adds at each pixel of its output (the
    input's size; taps on the border's zero padding included, as usual counts do, where XLA's
    own count leaves them out); the 2x2 pool after it halves the side (skipped once it is 1);
    then the two dense layers. 6 x params would undercount convs, whose weights are used at
    every pixel.
    """
    side, macs = cfg.image_size, 0
    widths = [cfg.in_channels, *cfg.channels]
    for c_in, c_out in itertools.pairwise(widths):
        macs += side * side * 9 * c_in * c_out
        side = side // 2 if side >= 2 else side
    macs += side * side * widths[-1] * cfg.hidden + cfg.hidden * cfg.classes
    return float(6 * macs * examples)


def analytic_flops(model: ModelConfig | None, examples: int,
                   seq_len: int | None = None) -> tuple[float, str] | None:
    """``(FLOPs of one training step, its formula)`` for a model trainrun builds from its
    config (``model``: the config's model section), or None for any other model: a model passed
    in may share weights or run them per position, and 6 x params x examples would misstate it.
    """
    if isinstance(model, TransformerModel):
        return transformer_flops(model, examples, seq_len), "analytic: 6*N*tokens + attention"
    if isinstance(model, MLPModel | NNXMLPModel):
        sizes = [model.features, *model.hidden, model.outputs]
        return dense_flops(sizes, examples), "analytic: 6*N*examples"
    if isinstance(model, CNNModel):
        return cnn_flops(model, examples), "analytic: 6*MACs*examples"
    return None
