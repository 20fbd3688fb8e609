#!/usr/bin/env bash
# trainrun's checks on one TPU chip, in one call of under nine minutes, each part printing what
# it found and a PASS/FAIL line; a summary table at the end:
#
#   1. the chip: JAX's backend, libtpu's version, the allocator's memory_stats; a process holds
#      the chip while `trainrun train` (one line naming the holder, exit 2) and `trainrun
#      launch` (one line, exit 2) try to start beside it
#   2. docs/guides/tpu.md's commands as written: the device check, a byte-LM run in bfloat16
#      with dropout (its summary names backend_start), `trainrun verify-resume` on it (the runs
#      one after another, PASS)
#   3. `trainrun verify-resume --config dpo` and `--config grpo` (a kill after a committed
#      checkpoint, resumed; PASS)
#   4. `trainrun train` at GPT-2 small (124M, 8 x 1024 tokens, K=10) on a token file, cold
#      (an empty compile cache) and again from the cache: backend start, init, compile and the
#      rest of each wall time; the programs the cold run compiled
#   5. the memory preflight: a byte LM whose step cannot fit the chip is refused in one line
#      naming the batch size that fits; a run at that size trains
#
#   bash benchmarks/tpu_checks.sh           # on the TPU machine, from the repository root
#   bash benchmarks/tpu_checks.sh --tiny    # every part at toy sizes on a CPU, where a CPU made
#                                           # to behave as a TPU host's chip holds for part 1
#
# Results go to $OUT (default: a new directory under /tmp): tpu_checks.log and the runs'
# summaries; the runs stay in a scratch directory. PY (default python3) is the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."

TINY=0
[[ "${1:-}" == "--tiny" ]] && TINY=1
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d /tmp/tpu-checks.XXXXXX)}
WORK=$(mktemp -d /tmp/tpu-checks-work.XXXXXX)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/tpu_checks.log") 2>&1
START=$SECONDS
RESULTS=()
part() { echo; echo "# $1 (at $((SECONDS - START)) s)"; echo; }
result() { RESULTS+=("| $1 | $2 | $3 |"); echo "$2: $1 ($3)"; }
elapsed() { echo $((SECONDS - START)); }

# `trainrun` and `python` as the guide writes them, run by this interpreter from this checkout
SHIM=$WORK/bin
mkdir -p "$SHIM"
printf '#!/bin/sh\nexec %s -m trainrun "$@"\n' "$(command -v "$PY")" > "$SHIM/trainrun"
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$PY")" > "$SHIM/python"
chmod +x "$SHIM/trainrun" "$SHIM/python"
export PATH=$SHIM:$PATH PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# a cache of compiled programs and kept figures of this call's own, as on a fresh machine
export TRAINRUN_CACHE_DIR=$WORK/cache

part "Part 1: the chip, and a chip another process holds"
HOLD=()  # the environment of the processes of this part: on a CPU, one made to hold as a chip
if [[ $TINY == 1 ]]; then
  HOLD=(env "PYTHONPATH=$PWD/tests/platform/one_process_cpu:$PYTHONPATH"
        "DEVICE_LOCK=$WORK/device.lock")
fi
"${HOLD[@]}" "$PY" - "$WORK/held" "$WORK/release" <<'EOF' &
import importlib.metadata, json, os, sys, time
import jax
device = jax.devices()[0]
try:
    libtpu = importlib.metadata.version("libtpu")
except importlib.metadata.PackageNotFoundError:
    libtpu = "not installed"
print(f"jax {jax.__version__}, libtpu {libtpu}, backend {jax.default_backend()}: "
      f"{jax.device_count()} x {device.device_kind}")
print("memory_stats of device 0:", json.dumps(device.memory_stats() or {}))
print(f"this process (pid {os.getpid()}) holds the device")
open(sys.argv[1], "w").close()
end = time.time() + 120
while not os.path.exists(sys.argv[2]) and time.time() < end:
    time.sleep(0.2)
EOF
HOLDER=$!
for _ in $(seq 600); do [[ -e $WORK/held ]] && break; sleep 0.1; done
"${HOLD[@]}" timeout 120 "$PY" -m trainrun train --run-dir "$WORK/beside" steps=2 \
  > "$WORK/beside.log" 2>&1
code=$?
echo "trainrun train beside it: exit $code"; tail -3 "$WORK/beside.log"
if [[ $code == 2 ]] && grep -q "^error: the TPU is held by process $HOLDER (" "$WORK/beside.log"; then
  result "train beside a holder: one line naming it" PASS "exit 2"
else
  result "train beside a holder: one line naming it" FAIL "exit $code"
fi
"${HOLD[@]}" timeout 60 "$PY" -m trainrun launch -n 2 -- train steps=2 > "$WORK/launch.log" 2>&1
code=$?
echo "trainrun launch: exit $code"; tail -3 "$WORK/launch.log"
if [[ $code == 2 ]] && grep -q "^error: trainrun launch runs 2 processes" "$WORK/launch.log"; then
  result "launch on the chip: one line" PASS "exit 2"
else
  result "launch on the chip: one line" FAIL "exit $code"
fi
touch "$WORK/release"
wait "$HOLDER"

part "Part 2: docs/guides/tpu.md as written"
mkdir -p "$WORK/guide"
"$PY" - docs/guides/tpu.md > "$WORK/guide/commands" <<'EOF'
import re, sys
# the ```bash blocks' commands, one per line, as tests/test_docs.py reads them
text = open(sys.argv[1]).read()
blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
    if line.strip() and not line.startswith("#"):
        print(line)
EOF
n=0
while IFS= read -r command; do
  n=$((n + 1))
  echo "\$ $command"
  t0=$SECONDS
  (cd "$WORK/guide" && timeout 300 bash -c "$command") > "$WORK/guide/$n.log" 2>&1
  code=$?
  grep -E "^(cpu|tpu) [0-9]|verify-resume:|^(run|uninterrupted|kill) |PASS|FAIL|wall time|^error" \
    "$WORK/guide/$n.log" | tail -12
  result "guide command $n: ${command:0:60}" "$([[ $code == 0 ]] && echo PASS || echo FAIL)" \
    "exit $code, $((SECONDS - t0)) s"
done < "$WORK/guide/commands"
cp "$WORK/guide/runs/lm-tpu/summary.json" "$OUT/lm-tpu.summary.json" 2> /dev/null

part "Part 3: verify-resume on the chip, DPO and GRPO"
if ! "$PY" -c "import jinja2, tokenizers" 2> /dev/null; then
  result "verify-resume dpo, grpo" SKIPPED "records need jinja2 and tokenizers (EXTRA= wheels)"
else
  if [[ $TINY == 1 ]]; then
    DPO=(steps=12 steps_per_call=2 checkpoint.every=4 model.d_model=16 model.layers=1
         data.synthetic_examples=128 data.batch_size=4 optimizer.schedule.warmup=2 --kill-at 4)
    GRPO=(steps=8 checkpoint.every=4 rl.prompts=2 rl.group=4 model.d_model=16 model.layers=1
          data.synthetic_examples=64 --kill-at 4)
  else
    DPO=(steps=100 checkpoint.every=50 --kill-at 50)
    GRPO=(steps=40 checkpoint.every=20 --kill-at 20)
  fi
  for kind in dpo grpo; do
    if [[ $kind == dpo ]]; then ARGS=("${DPO[@]}"); else ARGS=("${GRPO[@]}"); fi
    t0=$SECONDS
    timeout 200 "$PY" -m trainrun verify-resume --config $kind --work-dir "$WORK/verify-$kind" \
      eval.every=0 metrics.tensorboard=false "${ARGS[@]}" > "$WORK/verify-$kind.log" 2>&1
    code=$?
    grep -vE "^\s*$" "$WORK/verify-$kind.log" | tail -8
    result "verify-resume --config $kind" "$([[ $code == 0 ]] && echo PASS || echo FAIL)" \
      "exit $code, $((SECONDS - t0)) s"
  done
fi

part "Part 4: time to the first step at GPT-2 small, cold and from the compile cache"
if [[ $TINY == 1 ]]; then
  V=512; D=64; L=2; H=2; T=64; B=4; K=2; N=4
else
  V=50304; D=768; L=12; H=12; T=1024; B=8; K=10; N=20
fi
"$PY" - "$WORK/tokens.bin" $(( (N + 10) * B * (T + 1) )) $V <<'EOF'
import sys
import numpy as np
ids = np.random.default_rng(0).integers(0, int(sys.argv[3]), int(sys.argv[2]), dtype=np.int64)
ids.astype(np.uint16).tofile(sys.argv[1])
EOF
cat > "$WORK/gpt2.yaml" <<EOF
name: gpt2-shape
seed: 0
steps: $N
steps_per_call: $K
model: {kind: transformer, vocab: $V, d_model: $D, layers: $L, heads: $H, mlp_ratio: 4,
        seq_len: $T, positions: rope, dropout: 0.0, init_std: 0.02}
data: {kind: tokens, paths: $WORK/tokens.bin, dtype: uint16, seq_len: $T, batch_size: $B,
       shuffle: true, prefetch_threads: 2}
precision: {compute: bfloat16}
optimizer: {name: adamw, lr: 0.0006, b1: 0.9, b2: 0.95, weight_decay: 0.1}
eval: {every: 0}
checkpoint: {every: 0}
metrics: {every: $K, tensorboard: false}
EOF
split_line() {  # RUN: the summary's split of the wall time, and what came before the first step
  "$PY" - "$1/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
split = s["wall_time_split_s"]
before = sum(split.get(k, 0.0) for k in ("backend_start", "init", "compile"))
print(f"wall {s['wall_s']:.1f} s; before the first step (backend_start + init + compile) "
      f"{before:.1f} s; step {1e3 * (s['step_time_median_s'] or 0):.1f} ms")
print("  " + "  ".join(f"{k} {v:.2f}" for k, v in split.items() if v >= 0.005))
EOF
}
for pass in cold warm; do
  if [[ $pass == warm && $(elapsed) -gt 420 ]]; then
    result "gpt2 train, warm" SKIPPED "$(elapsed) s spent"; continue
  fi
  t0=$SECONDS
  TRAINRUN_COMPILATION_CACHE=$WORK/programs timeout 240 "$PY" -m trainrun train \
    --config "$WORK/gpt2.yaml" --run-dir "$WORK/gpt2-$pass" > "$WORK/gpt2-$pass.log" 2>&1
  code=$?
  echo "$pass: exit $code, process $((SECONDS - t0)) s"
  if [[ $code == 0 ]]; then
    split_line "$WORK/gpt2-$pass"
    cp "$WORK/gpt2-$pass/summary.json" "$OUT/gpt2-$pass.summary.json"
  else
    tail -5 "$WORK/gpt2-$pass.log"
  fi
  echo "programs in the cache after the $pass run:" \
    "$(ls "$WORK/programs" 2> /dev/null | grep -c -- '-cache$')" \
    "($(ls "$WORK/programs" 2> /dev/null | grep -- '-cache$' | sed 's/-[0-9a-f]*-cache$//' \
        | sort | uniq -c | tr -s ' ' | paste -sd, -))"
  result "gpt2 train, $pass" "$([[ $code == 0 ]] && echo PASS || echo FAIL)" \
    "exit $code, $((SECONDS - t0)) s"
done

part "Part 5: a step that cannot fit, refused naming the batch that does"
if (( $(elapsed) > 470 )); then
  result "memory refusal" SKIPPED "$(elapsed) s spent"
else
  if [[ $TINY == 1 ]]; then BIG=4096; else BIG=2048; fi  # rows of 1024 bytes
  LM=(--config lm data.seq_len=1024 precision.compute=bfloat16 eval.every=0
      metrics.tensorboard=false steps=2 steps_per_call=1)
  timeout 120 "$PY" -m trainrun train --run-dir "$WORK/big" "${LM[@]}" "data.batch_size=$BIG" \
    > "$WORK/big.log" 2>&1
  code=$?
  tail -2 "$WORK/big.log"
  fits=$(grep -oE "data\.batch_size=[0-9]+ fits" "$WORK/big.log" | grep -oE "[0-9]+" | head -1)
  if [[ $code == 2 && -n "$fits" && ! -e $WORK/big ]]; then
    result "memory refusal naming the batch that fits" PASS "batch $BIG refused, $fits fits"
    if [[ $TINY == 0 ]] && (( $(elapsed) < 500 )); then
      timeout 60 "$PY" -m trainrun train --run-dir "$WORK/fits" "${LM[@]}" \
        "data.batch_size=$fits" > "$WORK/fits.log" 2>&1
      code=$?
      tail -2 "$WORK/fits.log"
      result "a run at the batch named" "$([[ $code == 0 ]] && echo PASS || echo FAIL)" \
        "exit $code"
    fi
  else
    result "memory refusal naming the batch that fits" FAIL "exit $code"
  fi
fi

part "Summary ($(elapsed) s in all; results in $OUT, runs in $WORK)"
echo "| check | result | detail |"
echo "|---|---|---|"
printf '%s\n' "${RESULTS[@]}"
