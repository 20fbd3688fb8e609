#!/usr/bin/env bash
# bfloat16 vs float32 compute on one NVIDIA GPU: step time of a GPT-2-small-sized byte-level
# transformer (12 layers, d_model 768, 1024 context), params and optimizer state float32 masters
# either way. Also float16 with its dynamic loss scale.
#
#   bash benchmarks/gpu_precision.sh [BATCH] [STEPS_PER_ROUND] [ROUNDS]
#
# Needs jax[cuda] in .venv (pip install "jax[cuda12]==0.10.2"). Prints two tables (the
# contenders interleaved in one process each): one under JAX's default matmul precision, where
# NVIDIA GPUs may run float32 matmuls as TF32, and one with it set to "highest" (true float32),
# the fair float32 baseline. Expected on an H100/H200: bfloat16 several times faster than true
# float32, and ahead of the TF32 default too.
set -euo pipefail

BATCH=${1:-16}
STEPS=${2:-10}
ROUNDS=${3:-5}
PY=${PY:-.venv/bin/python}
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())")
if [[ "$BACKEND" != "gpu" ]]; then
  echo "no GPU backend (JAX sees: $BACKEND); install jax[cuda12] and run on a GPU machine" >&2
  exit 2
fi
"$PY" -c "import jax; d = jax.devices()[0]; print(f'{d.device_kind} x{jax.device_count()}')"

MODEL=(model.d_model=768 model.layers=12 model.heads=12 model.seq_len=1024
       data.seq_len=1024 "data.batch_size=$BATCH")

echo "== default matmul precision"
"$PY" benchmarks/precision.py --config lm --dtypes float32,bfloat16,float16 \
  --steps "$STEPS" --rounds "$ROUNDS" "${MODEL[@]}"

echo "== float32 matmuls at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest)"
JAX_DEFAULT_MATMUL_PRECISION=highest "$PY" benchmarks/precision.py --config lm \
  --dtypes float32,bfloat16 --steps "$STEPS" --rounds "$ROUNDS" "${MODEL[@]}"
