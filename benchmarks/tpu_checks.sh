#!/usr/bin/env bash
# trainrun's checks on one TPU chip in one call, each part printing what it found and a
# PASS/FAIL line, and a table of them at the end:
#
#   1. the chip: JAX's backend, libtpu's version, the allocator's memory_stats, the time JAX
#      takes to start it; then a process holds the chip while `trainrun train` (one line naming
#      the holder, exit 2) and `trainrun launch` (one line, exit 2) try to start beside it
#   2. docs/guides/tpu.md's commands as written: the device check, a byte-LM run in bfloat16
#      with dropout (its summary names backend_start), `trainrun verify-resume` on it (its runs
#      one after another, PASS)
#   3. `trainrun train` at GPT-2 small (124M, 8 x 1024 tokens, K=10) on a token file, cold
#      (an empty compile cache) and again from the cache: backend start, init, compile and the
#      rest of each wall time, the programs the cold run compiled, and each one's compile
#      figure split into XLA's compile and the compile cache's key, lookup and write
#   4. the memory preflight: a byte LM whose step cannot fit the chip, refused in one line
#      naming the batch size that does
#   5. `trainrun verify-resume --config dpo` and `--config grpo` (a kill after a committed
#      checkpoint, resumed; PASS; records need the jinja2, markupsafe and tokenizers wheels)
#   6. JAX's start with TPU_SKIP_MDS_QUERY=1 (libtpu not asking the cloud's metadata server),
#      against part 1's
#   7. `trainrun train` at the Qwen2.5-0.5B shape (4 x 2048 tokens), cold and warm, as
#      part 3 (layers under scan, rematerialized)
#
#   bash benchmarks/tpu_checks.sh           # on the TPU machine, from the repository root
#   bash benchmarks/tpu_checks.sh --tiny    # every part at toy sizes on a CPU (JAX_PLATFORMS
#                                           # unset), where part 1's chip is a CPU made to be
#                                           # held as one (tests/platform/one_process_cpu)
#   TPU_CHECK_PARTS="4 5" bash benchmarks/tpu_checks.sh    # only the parts listed
#   TPU_CHECK_GPT2_MODEL="scan_layers: true" ...           # part 3's model with these fields
#
# A part starts only if what it takes (its estimate on the chip) fits in what is left of
# TPU_CHECK_BUDGET_S (default 510 s): one left out is said in the table, to run in a second
# call with TPU_CHECK_PARTS. Results go to $OUT (default: a new directory under /tmp):
# tpu_checks.log and the runs' summaries; the runs stay in a scratch directory. PY (default
# python3) is the interpreter.
set -uo pipefail

main() {  # read whole before it runs: an edit of this file cannot change a run under way
cd "$(dirname "$0")/.."
TINY=0
[[ "${1:-}" == "--tiny" ]] && TINY=1
PY=${PY:-python3}
PARTS=" ${TPU_CHECK_PARTS:-1 2 3 4 5 6 7} "
PARTS=${PARTS//,/ }
BUDGET=${TPU_CHECK_BUDGET_S:-510}
OUT=${OUT:-$(mktemp -d /tmp/tpu-checks.XXXXXX)}
WORK=$(mktemp -d /tmp/tpu-checks-work.XXXXXX)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/tpu_checks.log") 2>&1
START=$SECONDS
RESULTS=()
part() { echo; echo "# Part $1 (at $((SECONDS - START)) s)"; echo; }
result() { RESULTS+=("| $1 | $2 | $3 |"); echo "$2: $1 ($3)"; }
# PART SECONDS NAME: whether part PART was asked for and its SECONDS (on the chip) fit the budget
want() {
  [[ "$PARTS" == *" $1 "* ]] || return 1
  if (( TINY == 0 && SECONDS - START + $2 > BUDGET )); then
    result "$3" SKIPPED "needs about $2 s, $((BUDGET - SECONDS + START)) s left"
    return 1
  fi
}
verdict() { [[ $1 == 0 ]] && echo PASS || echo FAIL; }

# `trainrun` and `python` as the guide writes them, run by this interpreter from this checkout
SHIM=$WORK/bin
mkdir -p "$SHIM"
printf '#!/bin/sh\nexec %s -m trainrun "$@"\n' "$(command -v "$PY")" > "$SHIM/trainrun"
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$PY")" > "$SHIM/python"
chmod +x "$SHIM/trainrun" "$SHIM/python"
export PATH=$SHIM:$PATH PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# a cache of compiled programs, kept figures and tokenized records of this call's own
export TRAINRUN_CACHE_DIR=$WORK/cache

if want 1 40 "the chip, and a chip another process holds"; then
part "1: the chip, and a chip another process holds"
HOLD=()  # the environment of this part's processes: on a CPU, one made to be held as a chip
if [[ $TINY == 1 ]]; then
  HOLD=(env -u JAX_PLATFORMS "PYTHONPATH=$PWD/tests/platform/one_process_cpu:$PYTHONPATH"
        "DEVICE_LOCK=$WORK/device.lock")
fi
"${HOLD[@]}" "$PY" - "$WORK/held" "$WORK/release" <<'EOF' &
import importlib.metadata, json, os, sys, time
started = time.perf_counter()
import jax
device = jax.devices()[0]
took = time.perf_counter() - started
try:
    libtpu = importlib.metadata.version("libtpu")
except importlib.metadata.PackageNotFoundError:
    libtpu = "not installed"
print(f"jax {jax.__version__}, libtpu {libtpu}, backend {jax.default_backend()}: "
      f"{jax.device_count()} x {device.device_kind}; import jax + jax.devices(): {took:.1f} s")
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
grep -q "^error: the TPU is held by process $HOLDER (" "$WORK/beside.log" || code="$code, no line"
result "train beside a holder: one line naming it" "$([[ $code == 2 ]] && echo PASS || echo FAIL)" \
  "exit $code"
"${HOLD[@]}" timeout 60 "$PY" -m trainrun launch -n 2 -- train steps=2 > "$WORK/launch.log" 2>&1
code=$?
echo "trainrun launch: exit $code"; tail -3 "$WORK/launch.log"
grep -q "^error: trainrun launch runs 2 processes" "$WORK/launch.log" || code="$code, no line"
result "launch on the chip: one line" "$([[ $code == 2 ]] && echo PASS || echo FAIL)" "exit $code"
touch "$WORK/release"
wait "$HOLDER"
fi

if want 2 190 "docs/guides/tpu.md as written"; then
part "2: docs/guides/tpu.md as written"
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
  (cd "$WORK/guide" && timeout 300 bash -c "$command") < /dev/null > "$WORK/guide/$n.log" 2>&1
  code=$?
  grep -E "^(cpu|tpu) [0-9]|verify-resume:|^(run|uninterrupted|kill) |PASS|FAIL|wall time|^error" \
    "$WORK/guide/$n.log" | tail -12
  result "guide command $n: ${command:0:50}..." "$(verdict $code)" \
    "exit $code, $((SECONDS - t0)) s"
done < "$WORK/guide/commands"
cp "$WORK/guide/runs/lm-tpu/summary.json" "$OUT/lm-tpu.summary.json" 2> /dev/null
fi

# SHAPE: `trainrun train` at SHAPE (gpt2: GPT-2 small, 8 x 1024 tokens, K=10; qwen: the
# Qwen2.5-0.5B shape, 4 x 2048 tokens, K=4, layers under scan, rematerialized) on a token file,
# cold (an empty compile cache) and again from the cache
first_step() {
local shape=$1 MODEL pass t0 code kept largest
if [[ $shape == gpt2 ]]; then
  if [[ $TINY == 1 ]]; then V=512; D=64; L=2; H=2; KV=2; F=256; T=64; B=4; K=2; N=4
  else V=50304; D=768; L=12; H=12; KV=12; F=3072; T=1024; B=8; K=10; N=20; fi
  MODEL="mlp_ratio: 4${TPU_CHECK_GPT2_MODEL:+, $TPU_CHECK_GPT2_MODEL}"
else
  if [[ $TINY == 1 ]]; then V=1000; D=64; L=2; H=4; KV=2; F=256; T=64; B=4; K=2; N=4
  else V=151936; D=896; L=24; H=14; KV=2; F=4864; T=2048; B=4; K=4; N=8; fi
  MODEL="kv_heads: $KV, mlp: swiglu, mlp_hidden: $F, norm: rmsnorm, norm_eps: 1.0e-6,
        rope_theta: 1000000.0, qkv_bias: true, scan_layers: true, remat: full"
fi
"$PY" - "$WORK/tokens-$shape.bin" $(( (N + 10) * B * (T + 1) )) $V <<'PYEOF'
import sys
import numpy as np
ids = np.random.default_rng(0).integers(0, int(sys.argv[3]), int(sys.argv[2]), dtype=np.int64)
ids.astype(np.uint32).tofile(sys.argv[1])
PYEOF
cat > "$WORK/$shape.yaml" <<YAMLEOF
name: $shape-shape
seed: 0
steps: $N
steps_per_call: $K
model: {kind: transformer, vocab: $V, d_model: $D, layers: $L, heads: $H, $MODEL,
        seq_len: $T, positions: rope, dropout: 0.0, init_std: 0.02}
data: {kind: tokens, paths: $WORK/tokens-$shape.bin, dtype: uint32, seq_len: $T, batch_size: $B,
       shuffle: true, prefetch_threads: 2}
precision: {compute: bfloat16}
optimizer: {name: adamw, lr: 0.0006, b1: 0.9, b2: 0.95, weight_decay: 0.1}
eval: {every: 0}
checkpoint: {every: 0}
metrics: {every: $K, tensorboard: false}
YAMLEOF
for pass in cold warm; do
  t0=$SECONDS
  # jax._src.compiler's debug lines hold XLA's own compile seconds, without the cache's work
  JAX_LOG_COMPILES=1 JAX_DEBUG_LOG_MODULES=jax._src.compiler \
    TRAINRUN_COMPILATION_CACHE=$WORK/programs-$shape timeout 240 \
    "$PY" -m trainrun train \
    --config "$WORK/$shape.yaml" --run-dir "$WORK/$shape-$pass" > "$WORK/$shape-$pass.log" 2>&1
  code=$?
  echo "$shape $pass: exit $code, process $((SECONDS - t0)) s"
  if [[ $code == 0 ]]; then
    "$PY" - "$WORK/$shape-$pass/summary.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
split = s["wall_time_split_s"]
before = sum(split.get(k, 0.0) for k in ("backend_start", "init", "compile"))
print(f"wall {s['wall_s']:.1f} s; backend_start + init + compile {before:.1f} s; "
      f"init + compile {before - split.get('backend_start', 0.0):.1f} s; "
      f"step {1e3 * (s['step_time_median_s'] or 0):.1f} ms; MFU {s.get('mfu')}")
print("  " + "  ".join(f"{k} {v:.2f}" for k, v in split.items() if v >= 0.005))
PYEOF
    cp "$WORK/$shape-$pass/summary.json" "$OUT/$shape-$pass.summary.json"
    "$PY" - "$WORK/$shape-$pass.log" <<'PYEOF'
import collections, re, sys
# JAX's own timings of each program's stages (JAX_LOG_COMPILES), summed by program
stages = {"trace": r"Finished tracing (\S+) for jit in ([0-9.]+) sec",
          "lower": r"Finished jaxpr to MLIR module conversion jit\((\S+)\) in ([0-9.]+) sec",
          "compile": r"Finished XLA compilation of jit\((\S+)\) in ([0-9.]+) sec"}
took: dict = collections.defaultdict(collections.Counter)
text = open(sys.argv[1], errors="replace").read()
for stage, pattern in stages.items():
    for name, seconds in re.findall(pattern, text):
        took[name][stage] += float(seconds)
hits = len(re.findall(r"[Pp]ersistent compilation cache hit", text))
big = sorted(took.items(), key=lambda kv: -sum(kv[1].values()))
print("  JAX's stages, s (trace / lower / compile): " + "; ".join(
    f"{name} {c['trace']:.1f} / {c['lower']:.1f} / {c['compile']:.1f}" for name, c in big[:6]
    if sum(c.values()) >= 0.05) + f"; cache hits {hits}")
# XLA's compile alone (jax._src.compiler, debug); JAX's compile figure less it is the
# persistent cache's key, lookup and write of the executable
xla: collections.Counter = collections.Counter()
for name, seconds in re.findall(r"'(?:jit_)?(\S+)' took at least [0-9.]+ seconds to compile "
                                r"\(([0-9.]+)s\)", text):
    xla[name] += float(seconds)
print("  JAX's compile figure = XLA's compile + the cache's key, lookup and write, s: " + (
    "; ".join(f"{name} {c['compile']:.1f} = {xla[name]:.1f} + {c['compile'] - xla[name]:.1f}"
              for name, c in big[:3] if name in xla) or "none compiled"))
PYEOF
  else
    tail -5 "$WORK/$shape-$pass.log"
  fi
  kept=$(ls "$WORK/programs-$shape" 2> /dev/null | grep -- '-cache$' \
         | sed 's/-[0-9a-f]*-cache$//' | sort | uniq -c \
         | awk '{printf "%s%s x%s", (NR > 1 ? ", " : ""), $2, $1}')
  echo "programs in the cache after the $pass run: $kept"
  largest=$(ls -S "$WORK/programs-$shape" 2> /dev/null | grep -- '-cache$' | head -1)
  [[ -n $largest ]] && echo "the largest: ${largest%%-*}, $(( $(stat -c %s \
    "$WORK/programs-$shape/$largest") / 1000000 )) MB"
  result "$shape train, $pass" "$(verdict $code)" "exit $code, $((SECONDS - t0)) s"
done
}

if want 3 140 "gpt2 train, cold and warm"; then
part "3: time to the first step at GPT-2 small, cold and from the compile cache"
first_step gpt2
fi

if want 7 200 "the Qwen2.5-0.5B shape's train, cold and warm"; then
part "7: time to the first step at the Qwen2.5-0.5B shape, cold and from the compile cache"
first_step qwen
fi

if want 4 50 "memory refusal naming the batch that fits"; then
part "4: a step that cannot fit, refused naming the batch that does"
if [[ $TINY == 1 ]]; then BIG=1024; else BIG=2048; fi  # rows of 1024 bytes
timeout 200 "$PY" -m trainrun train --run-dir "$WORK/big" --config lm data.seq_len=1024 \
  "data.batch_size=$BIG" precision.compute=bfloat16 optimizer.schedule.warmup=0 eval.every=0 \
  metrics.tensorboard=false steps=2 steps_per_call=1 > "$WORK/big.log" 2>&1
code=$?
tail -2 "$WORK/big.log"
fits=$(grep -oE "data\.batch_size=[0-9]+ fits" "$WORK/big.log" | grep -oE "[0-9]+" | head -1)
[[ -n "$fits" && ! -e $WORK/big ]] || code="$code, no batch named or a run directory left"
result "memory refusal naming the batch that fits" "$([[ $code == 2 ]] && echo PASS || echo FAIL)" \
  "batch $BIG: exit $code${fits:+, $fits fits}"
fi

if [[ "$PARTS" == *" 5 "* ]] && ! "$PY" -c "import jinja2, tokenizers" 2> /dev/null; then
  result "verify-resume dpo, grpo" SKIPPED "records need jinja2, markupsafe and tokenizers wheels"
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
    want 5 90 "verify-resume --config $kind" || continue
    part "5: verify-resume --config $kind on the chip"
    if [[ $kind == dpo ]]; then ARGS=("${DPO[@]}"); else ARGS=("${GRPO[@]}"); fi
    t0=$SECONDS
    timeout 200 "$PY" -m trainrun verify-resume --config $kind --work-dir "$WORK/verify-$kind" \
      eval.every=0 metrics.tensorboard=false "${ARGS[@]}" > "$WORK/verify-$kind.log" 2>&1
    code=$?
    grep -vE "^\s*$" "$WORK/verify-$kind.log" | tail -8
    result "verify-resume --config $kind" "$(verdict $code)" "exit $code, $((SECONDS - t0)) s"
  done
fi

if want 6 20 "JAX's start with TPU_SKIP_MDS_QUERY=1"; then
part "6: JAX's start without the metadata server's query"
TPU_SKIP_MDS_QUERY=1 timeout 60 "$PY" -c "
import time; started = time.perf_counter()
import jax; devices = jax.devices()
print(f'TPU_SKIP_MDS_QUERY=1: import jax + jax.devices(): {time.perf_counter() - started:.1f} s,'
      f' {len(devices)} x {devices[0].device_kind}')"
code=$?
result "JAX's start with TPU_SKIP_MDS_QUERY=1" "$(verdict $code)" "exit $code (a measurement)"
fi

echo; echo "# Summary: $((SECONDS - START)) s in all; results in $OUT, runs in $WORK"; echo
echo "| check | result | detail |"
echo "|---|---|---|"
printf '%s\n' "${RESULTS[@]}"
}

main "$@"
