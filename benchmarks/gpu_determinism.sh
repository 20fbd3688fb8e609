#!/usr/bin/env bash
# Bitwise resume on a GPU: `trainrun verify-resume` on the transformer LM (dropout, shuffled
# data, an embedding gradient that is a scatter-add) with XLA's deterministic GPU ops (the
# CLI's default where a GPU plugin is installed) and without them, repeated; then the
# throughput each setting gets on the same run. Prints a table.
#
#   bash benchmarks/gpu_determinism.sh [REPEATS] [STEPS]
#
# Needs NVIDIA GPUs and jax[cuda12]==0.10.2 in .venv. Contenders run one after another on the
# same idle machine.
set -euo pipefail

REPEATS=${1:-3}
STEPS=${2:-300}
PY=${PY:-.venv/bin/python}
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())")
if [[ "$BACKEND" != "gpu" ]]; then
  echo "no GPU backend (JAX sees: $BACKEND); install jax[cuda12] and run on a GPU machine" >&2
  exit 2
fi
LM=(--config lm model.dropout=0.1 eval.every=0 metrics.tensorboard=false)
declare -A FLAGS=([deterministic]="--xla_gpu_deterministic_ops=true"
                  [default-xla]="--xla_gpu_deterministic_ops=false")

echo "| XLA GPU ops | verify-resume passes | steps/s |"
echo "|---|---:|---:|"
for name in deterministic default-xla; do
  passes=0
  for _ in $(seq "$REPEATS"); do
    if XLA_FLAGS="${FLAGS[$name]}" "$PY" -m trainrun verify-resume "${LM[@]}" steps=60 \
        checkpoint.every=20 optimizer.schedule.warmup=10 > /dev/null; then
      passes=$((passes + 1))
    fi
  done
  dir=$(mktemp -d /tmp/trainrun-gpu-det.XXXXXX)
  XLA_FLAGS="${FLAGS[$name]}" "$PY" -m trainrun train --run-dir "$dir/run" "${LM[@]}" \
    "steps=$STEPS" checkpoint.every=0 > /dev/null
  rate=$("$PY" -c "import json; print(round(json.load(open('$dir/run/summary.json'))['steps_per_s'], 1))")
  echo "| $name | $passes/$REPEATS | $rate |"
done
