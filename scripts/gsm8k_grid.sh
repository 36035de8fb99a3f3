#!/usr/bin/env bash
# Issue 6's accuracy grid: Qwen2.5-Coder-1.5B (bundled, fp32), the first 30 GSM8K test problems,
# full plus every registered method at budgets 256 and 128, 512 new tokens, greedy.
#
# The (method, budget) cells form one queue that WORKERS 1-thread processes take from in order
# (a cell is claimed by creating $OUT/.queue/<cell>), so neither process idles while the other
# still has a long list. Resumable: run it again after a crash or a stop; cells with all their rows
# are skipped without loading the model and a half-done cell continues where it stopped. The rows
# live in results/ (tracked by git, so a fresh checkout keeps them). On the 2-core CPU a cell of 30
# problems takes ~15-25 min per process; the whole grid is several CPU-hours.
#
#   scripts/gsm8k_grid.sh            # full first, then the queue
#   kvsieve report results/gsm8k-qwen2.5-coder-1.5b
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gsm8k-qwen2.5-coder-1.5b}
# Built on first use (~16 min) and not tracked; run.json records its sha256, so eval refuses a
# different vector for the skipkv+steer rows already written.
STEER=${STEER:-results/steer-qwen2.5-coder-1.5b.pt}
KVSIEVE=${KVSIEVE:-.venv/bin/kvsieve}
PYTHON=${PYTHON:-.venv/bin/python}
WORKERS=${WORKERS:-2}
LIMIT=30
BUDGETS=(256 128)
# The five seed methods first, then the baselines; each method's two budgets sit next to each other.
METHODS=${METHODS:-lazy,ams:tova,lagkv,skipkv,skipkv+steer,caote:tova,fastcaote:tova,tova,h2o,snapkv,rkv,expected,\
streaming,ams:expected,ams:rkv,caote:h2o,keydiff,knorm,random,localkv,raas,lagkv-l2}
COMMON=(--model qwen2.5-coder-1.5b --dataset gsm8k --limit "$LIMIT" --max-new-tokens 512 --batch-size 30
        --out "$OUT" --no-progress)
# AMS's Table 15 interval (512), also Expected Attention's, would never compress within 512 new
# tokens; 64 is a quarter of the larger budget and half of the smaller.
# Budgets 128 and 256 are below every setting of LagKV's paper grid at this horizon (the smallest
# that fits is 320 to 400 tokens), which the fit refuses unless off_grid is set: its cells run off
# the grid, as the recorded rows did (L 16, r 1/8 at 128, under an earlier fit rule; each row's
# settings hold its L and r).
declare -A SETTINGS=([ams:tova]=interval=64 [ams:expected]=interval=64 [ams:rkv]=interval=64 [expected]=interval=64
                     [lagkv]=off_grid=true [localkv]=off_grid=true [lagkv-l2]=off_grid=true)

mkdir -p "$OUT"
# full alone first: it is every cell's reference.
OMP_NUM_THREADS=2 "$KVSIEVE" eval "${COMMON[@]}" --methods full

# Cells that already have $LIMIT rows (in any results file) need no model load.
# load_results is what eval resumes from: merged files, duplicates dropped, a torn last line skipped.
complete=$("$PYTHON" - "$OUT" "$LIMIT" <<'PY'
import collections, sys
from kvsieve.eval.store import load_results
rows = collections.Counter((row["method"], row["budget"]) for row in load_results(sys.argv[1]))
print(" ".join(f"{m}@{b}" for (m, b), n in rows.items() if n >= int(sys.argv[2])))
PY
)

QUEUE="$OUT/.queue"  # claims of this invocation only: cleared at start
rm -rf "$QUEUE" && mkdir -p "$QUEUE"
run_cell() {  # worker tag, method, budget
  local tag=$1 method=$2 budget=$3 extra=()
  [[ -n "${SETTINGS[$method]:-}" ]] && extra+=(--set "$method.${SETTINGS[$method]}")
  if [[ $method == *+steer ]]; then
    # One worker builds the steering vector (16 GSM8K-train answers, ~10 min); another waits for it.
    if [[ ! -f "$STEER" ]] && mkdir "$QUEUE/steering-build" 2>/dev/null; then
      OMP_NUM_THREADS=1 "$KVSIEVE" steering build --model qwen2.5-coder-1.5b --samples 16 --out "$STEER.partial.pt" \
        && mv "$STEER.partial.pt" "$STEER" || { touch "$QUEUE/steering-failed"; return 1; }
    fi
    while [[ ! -f "$STEER" ]]; do
      [[ -e "$QUEUE/steering-failed" ]] && { echo "steering build failed: see the other worker's log"; return 1; }
      sleep 20
    done
    extra+=(--steering "$STEER")
  fi
  echo "$(date -u +%H:%M:%S) worker $tag: $method@$budget"
  OMP_NUM_THREADS=1 "$KVSIEVE" eval "${COMMON[@]}" --methods "$method" --budgets "$budget" --writer "$tag" "${extra[@]}"
}
worker() {  # tag: take the next unclaimed, incomplete cell until none is left
  local tag=$1 method budget pass
  for pass in first last; do  # a steered cell waits for the vector another worker builds: do others first
    for method in ${METHODS//,/ }; do
      for budget in "${BUDGETS[@]}"; do
        [[ " $complete " == *" $method@$budget "* ]] && continue
        [[ $pass == first && $method == *+steer && ! -f "$STEER" ]] && compgen -G "$QUEUE/*+steer@*" > /dev/null && continue
        mkdir "$QUEUE/$method@$budget" 2>/dev/null || continue
        run_cell "$tag" "$method" "$budget" >> "$OUT/$tag.log" 2>&1 || echo "$method@$budget failed: see $OUT/$tag.log"
      done
    done
  done
}
for i in $(seq 1 "$WORKERS"); do worker "w$i" & done
wait
rm -rf "$QUEUE"
