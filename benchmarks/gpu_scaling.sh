#!/usr/bin/env bash
# Data parallel vs FSDP (vs data x tensor) on every GPU of this machine: the same transformer LM
# run, only the mesh changes. Prints a table of step time and throughput with ratios to data
# parallel, and how far each run's losses are from data parallel's.
#
#   bash benchmarks/gpu_scaling.sh [STEPS] [D_MODEL] [LAYERS]
#
# Needs a machine with NVIDIA GPUs and jax[cuda] installed in .venv (pip install
# "jax[cuda12]==0.10.2"). Each contender is one `trainrun train` process over all local GPUs;
# they run one after another on the same idle machine, so their ratios are comparable.
set -euo pipefail

STEPS=${1:-300}
D_MODEL=${2:-1024}
LAYERS=${3:-8}
PY=${PY:-.venv/bin/python}
OUT=$(mktemp -d /tmp/trainrun-gpu-scaling.XXXXXX)
GPUS=$("$PY" -c "import jax; print(jax.device_count())")
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())")
if [[ "$BACKEND" != "gpu" ]]; then
  echo "no GPU backend (JAX sees: $BACKEND); install jax[cuda12] and run on a GPU machine" >&2
  exit 2
fi

cat > "$OUT/lm.yaml" <<EOF
# The scaling run: a byte-level transformer LM on Python's standard library sources.
name: gpu-scaling          # run name
seed: 0                    # init and step keys
steps: $STEPS              # optimizer updates
steps_per_call: 10         # K steps fused per dispatch
model:
  kind: transformer        # decoder-only LM
  vocab: 256               # bytes
  d_model: $D_MODEL        # width
  layers: $LAYERS          # blocks
  heads: 16                # attention heads
  seq_len: 512             # context length
data:
  kind: text               # stdlib .py files as bytes
  seq_len: 512             # window length
  batch_size: $((16 * GPUS))  # 16 sequences per GPU
optimizer:
  name: adamw              # AdamW
  lr: 3.0e-4               # learning rate
checkpoint:
  every: 0                 # only the final checkpoint
metrics:
  every: 100               # console line interval
EOF

declare -A MESHES=(
  [data_parallel]="mesh.data=-1"
  [fsdp]="mesh.data=1 mesh.fsdp=-1 mesh.fsdp_min_size=0"
)
if (( GPUS % 2 == 0 && GPUS >= 2 )); then
  MESHES[data_x_tensor2]="mesh.data=-1 mesh.tensor=2"
fi

for name in data_parallel fsdp data_x_tensor2; do
  [[ -n "${MESHES[$name]:-}" ]] || continue
  echo "== $name: ${MESHES[$name]}"
  # shellcheck disable=SC2086
  "$PY" -m trainrun train --config "$OUT/lm.yaml" --run-dir "$OUT/$name" ${MESHES[$name]}
done

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

root = Path(sys.argv[1])
runs = {p.name: json.loads((p / "summary.json").read_text())
        for p in sorted(root.iterdir()) if (p / "summary.json").exists()}
losses = {name: [json.loads(l)["loss"] for l in (root / name / "metrics.jsonl").open()]
          for name in runs}
base = runs["data_parallel"]
prov = base["provenance"]
print(f"\n{prov['device_count']} x {prov['device_kind']}, jax {prov['jax']}")
print(f"{'mesh':<16} {'step ms':>9} {'examples/s':>12} {'vs data parallel':>17} "
      f"{'final loss':>11} {'max rel. loss diff':>19}")
for name, s in runs.items():
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["data_parallel"]))
    print(f"{name:<16} {s['step_time_median_s'] * 1e3:>9.2f} {s['examples_per_s']:>12,.0f} "
          f"{s['examples_per_s'] / base['examples_per_s']:>16.2f}x {s['final_loss']:>11.5f} "
          f"{diff:>19.2e}")
EOF
echo "run directories: $OUT"
