#!/usr/bin/env bash
# A GPT-2-small-sized LM (12 layers, d_model 768, 12 heads, 1024 context, vocabulary 50304:
# 124M parameters) trained by trainrun's own step in bfloat16 on one NVIDIA GPU (written for an
# H200): tokens/s and MFU against the bfloat16 matmul rate measured on the same GPU first.
#
#   bash benchmarks/gpu_lm.sh [BATCH] [STEPS_PER_CALL] [ROUNDS]
#
# Needs jax[cuda] in .venv (pip install "jax[cuda12]==0.10.2"). The step is trainrun's
# make_train_step (AdamW, float32 master params, bfloat16 compute, the transformer's attention
# through cuDNN's fused kernel), K steps per call under lax.scan, the state donated; tokens are
# random ids already on the device (this measures the step, not a data pipeline). MFU counts the
# model's FLOPs (6 x params x tokens + 12 x layers x seq x d_model x tokens, causal mask not
# discounted) over the measured rate of a large bfloat16 matmul, and over the datasheet peak.
# Target: MFU of at least 45% of the measured rate.
set -euo pipefail

BATCH=${1:-32}
STEPS=${2:-10}
ROUNDS=${3:-5}
PY=${PY:-.venv/bin/python}
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())")
if [[ "$BACKEND" != "gpu" ]]; then
  echo "no GPU backend (JAX sees: $BACKEND); install jax[cuda12] and run on a GPU machine" >&2
  exit 2
fi

"$PY" - "$BATCH" "$STEPS" "$ROUNDS" <<'EOF'
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from trainrun.config import OptimizerConfig, TransformerModel
from trainrun.loop import init_state
from trainrun.models.transformer import make_transformer
from trainrun.optim import build_optimizer
from trainrun.precision import Policy
from trainrun.step import make_multi_step, make_train_step

batch, k, rounds = (int(a) for a in sys.argv[1:4])
device = jax.devices()[0]
print(f"{device.device_kind} x{jax.device_count()}, jax {jax.__version__}")


def bf16_matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    """FLOP/s of an n-square bfloat16 matmul (float32 accumulation), median of repeats."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16))
    matmul(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


peak = bf16_matmul_rate()
cfg = TransformerModel(vocab=50304, d_model=768, layers=12, heads=12, seq_len=1024,
                       positions="rope", dropout=0.0, init_std=0.02)
optim = OptimizerConfig(name="adamw", lr=6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
model, optimizer = make_transformer(cfg), build_optimizer(optim)
policy = Policy(compute=jnp.bfloat16)
state = init_state(model, optimizer, seed=0, policy=policy)
params = sum(x.size for x in jax.tree.leaves(state.params))
step = jax.jit(make_multi_step(make_train_step(model, optimizer, policy=policy)),
               donate_argnums=0)
tokens = jax.random.randint(jax.random.key(2), (k, batch, cfg.seq_len + 1), 0, cfg.vocab,
                            jnp.int32)
for _ in range(2):  # compile, then one more call so allocation settles
    state, metrics = step(state, {"tokens": tokens})
jax.block_until_ready(metrics)

times = []
for _ in range(rounds):
    start = time.perf_counter()
    state, metrics = step(state, {"tokens": tokens})
    jax.block_until_ready(metrics)
    times.append((time.perf_counter() - start) / k)
step_s = statistics.median(times)
per_step_tokens = batch * cfg.seq_len
flops = (6 * params * per_step_tokens
         + 12 * cfg.layers * cfg.seq_len * cfg.d_model * per_step_tokens)
achieved = flops / step_s
datasheet = 989e12 if "H100" in device.device_kind or "H200" in device.device_kind else None
print(f"\nGPT-2 small shape, {params / 1e6:.1f}M params, batch {batch} x {cfg.seq_len} tokens, "
      f"bfloat16 compute, K={k} steps per call, median of {rounds} calls")
print("| step ms | tokens/s | model TFLOP/s | bf16 matmul TFLOP/s (measured) | MFU vs measured "
      "| MFU vs datasheet | loss |")
print("|---:|---:|---:|---:|---:|---:|---:|")
print(f"| {step_s * 1e3:.1f} | {per_step_tokens / step_s:,.0f} | {achieved / 1e12:.1f} | "
      f"{peak / 1e12:.1f} | {achieved / peak:.1%} | "
      f"{(f'{achieved / datasheet:.1%}' if datasheet else 'n/a')} | "
      f"{float(metrics['loss'][-1]):.3f} |")
EOF
