#!/usr/bin/env bash
# Issue 6's accuracy grid: Qwen2.5-Coder-1.5B (bundled, fp32), the first 30 GSM8K test problems,
# full plus every registered method at budgets 256 and 128, 512 new tokens, greedy.
#
# Resumable: run it again after a crash or a stop and finished rows are skipped. The rows live in
# results/ (tracked by git, so a fresh checkout keeps them). On the 2-core CPU a cell of 30
# problems takes ~15-25 min per process; the whole grid is several CPU-hours.
#
#   scripts/gsm8k_grid.sh            # full first, then one 1-thread process per budget
#   kvsieve report results/gsm8k-qwen2.5-coder-1.5b
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gsm8k-qwen2.5-coder-1.5b}
STEER=${STEER:-results/steer-qwen2.5-coder-1.5b.pt}
KVSIEVE=${KVSIEVE:-.venv/bin/kvsieve}
# The five seed methods first, then the baselines (each process runs its cells in this order).
METHODS=${METHODS:-lazy,ams:tova,lagkv,skipkv,caote:tova,fastcaote:tova,tova,h2o,snapkv,rkv,expected,streaming,\
ams:expected,ams:rkv,caote:h2o,keydiff,knorm,random,localkv,raas,lagkv-l2,skipkv+steer}
COMMON=(--model qwen2.5-coder-1.5b --dataset gsm8k --limit 30 --max-new-tokens 512 --batch-size 30
        --out "$OUT" --no-progress)
# AMS's Table 15 interval (512), also Expected Attention's, would never compress within 512 new
# tokens; 64 is a quarter of the larger budget and half of the smaller.
SETTINGS=(--set ams:tova.interval=64 --set ams:expected.interval=64 --set ams:rkv.interval=64
          --set expected.interval=64)
mkdir -p "$OUT"
if [[ ",$METHODS," == *"+steer,"* && ! -f "$STEER" ]]; then
  echo "building the SkipKV steering vector $STEER (16 GSM8K-train answers)"
  "$KVSIEVE" steering build --model qwen2.5-coder-1.5b --samples 16 --out "$STEER"
fi
steering=()
[[ ",$METHODS," == *"+steer,"* ]] && steering=(--steering "$STEER")
# full alone first: it is every cell's reference, and each process would otherwise run it too.
OMP_NUM_THREADS=2 "$KVSIEVE" eval "${COMMON[@]}" --methods full
for budget in 256 128; do
  OMP_NUM_THREADS=1 "$KVSIEVE" eval "${COMMON[@]}" --methods "$METHODS" --budgets "$budget" --writer "b$budget" \
    "${SETTINGS[@]}" "${steering[@]}" > "$OUT/b$budget.log" 2>&1 &
done
wait
