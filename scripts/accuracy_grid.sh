#!/usr/bin/env bash
# Issue 35's accuracy grid: Qwen2.5-Coder-1.5B (bundled, fp32, greedy), every cell from one pinned commit.
#
#   scripts/accuracy_grid.sh pin COMMIT     record the commit the grid runs (results/accuracy-grid/PIN)
#   scripts/accuracy_grid.sh run [STAGE..]  resume the stages (default: 1 2), nice'd, in the foreground
#   scripts/accuracy_grid.sh start [STAGE..] the same under nohup in the background (log: results/accuracy-grid/grid.log)
#   scripts/accuracy_grid.sh status         rows per cell so far
#
# The code runs from a git worktree at the pinned commit ($GRID_TREE, made on first use), with this
# checkout's venv; rows go to results/accuracy-grid/<stage>/ of this checkout, so a session commits
# them from main while main moves on.  `kvsieve eval --pin-commit` records the commit in each
# stage's run.json and refuses rows from any other one.  Resumable: a rerun decodes only the samples
# that have no row yet (a row is written as each sample ends).
#
# Stages (issue 35):
#   1  GSM8K test 0-99, budget 128, 512 new tokens: 11 methods, the four seed methods that have a budget
#      with their prompt protected (+protect; LagKV's partitions cannot set the prompt apart), and rkv
#      with its prompt competing (+competes) beside its default (kept), so it compares like with like
#   2  MATH-500 problems 100-149, budget 256, 768 new tokens: the 11 methods
#   3  GSM8K test 0-99, budget 64, 512 new tokens: the five seed methods and random
#
# Settings that are not a method's default, each the setting of the comparison its paper makes:
#   tova      prefill_block=true: CAOTE compares with its bases under block-wise prefill (Table 10)
#   h2o       recent=W (LazyEviction App. C: H2O's recent window equals LazyEviction's W = 25)
#   lagkv     L=128, r=1/8: the smallest setting of Sec. 3.1's grid (no grid setting fits budget 128 at
#             these lengths); one cell without a budget, placed by its measured peak KV
# Everything else runs at its defaults (lazy: W = 25, the paper's; AMS and Expected: interval capped at
# budget // 2 by the policy).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GRID=results/accuracy-grid
GRID_TREE=${GRID_TREE:-$ROOT/../kvsieve-grid-tree}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BATCH=${BATCH:-50}
THREADS=${THREADS:-2}

METHODS=full,lazy,ams:tova,skipkv,caote:tova,lagkv,tova,h2o,rkv,expected,random
PROTECTED=lazy+protect,ams:tova+protect,skipkv+protect,caote:tova+protect,rkv+competes
SETTINGS=(--set tova.prefill_block=true --set h2o.recent_rule=lazy-window --set lagkv.lag=128 --set lagkv.ratio=0.125
          --set lazy+protect.protect_prompt=true --set ams:tova+protect.protect_prompt=true
          --set skipkv+protect.protect_prompt=true --set caote:tova+protect.protect_prompt=true
          --set rkv+competes.protect_prompt=false)

stage_args() {  # stage -> its eval arguments
  case $1 in
    1) echo "--dataset gsm8k --data ../shared/data/gsm8k_test.jsonl --limit 100 --budgets 128 --max-new-tokens 512
             --methods $METHODS,$PROTECTED --out $GRID/stage1-gsm8k-b128" ;;
    2) echo "--dataset math500 --data ../shared/data/math500.jsonl --skip 100 --limit 50 --budgets 256
             --max-new-tokens 768 --methods $METHODS --out $GRID/stage2-math500-b256" ;;
    3) echo "--dataset gsm8k --data ../shared/data/gsm8k_test.jsonl --limit 100 --budgets 64 --max-new-tokens 512
             --methods full,lazy,ams:tova,skipkv,caote:tova,lagkv,random --out $GRID/stage3-gsm8k-b64" ;;
    *) echo "unknown stage $1 (1, 2 or 3)" >&2; return 1 ;;
  esac
}

tree() {  # the pinned worktree, made on first use
  [[ -f $GRID/PIN ]] || { echo "no pinned commit: scripts/accuracy_grid.sh pin COMMIT" >&2; exit 1; }
  local pin
  pin=$(cat $GRID/PIN)
  if [[ ! -d $GRID_TREE ]]; then
    git worktree prune
    git worktree add --detach "$GRID_TREE" "$pin" >&2
  fi
  [[ $(git -C "$GRID_TREE" rev-parse HEAD) == "$pin" ]] || { echo "$GRID_TREE is not at $pin" >&2; exit 1; }
}

run_stage() {
  local args
  args=$(stage_args "$1")
  echo "$(date -u +%FT%TZ) stage $1: start"
  # shellcheck disable=SC2086  # stage_args is a word list
  PYTHONPATH=$GRID_TREE/src OMP_NUM_THREADS=$THREADS nice -n 10 "$PYTHON" -m kvsieve.eval eval \
    --model qwen2.5-coder-1.5b $args --batch-size "$BATCH" --pin-commit --no-progress "${SETTINGS[@]}"
  echo "$(date -u +%FT%TZ) stage $1: done"
}

case ${1:-run} in
  pin)
    [[ -n ${2:-} ]] || { echo "usage: $0 pin COMMIT" >&2; exit 2; }
    mkdir -p $GRID && git rev-parse --verify "$2^{commit}" > $GRID/PIN && cat $GRID/PIN ;;
  run)
    shift || true
    tree
    for stage in "${@:-1 2}"; do for s in $stage; do run_stage "$s"; done; done ;;
  start)
    shift || true
    tree
    mkdir -p $GRID
    nohup "$0" run "$@" >> $GRID/grid.log 2>&1 &
    echo "started (pid $!); follow it with: tail -f $GRID/grid.log" ;;
  status)
    "$PYTHON" - "$GRID" <<'PY'
import collections, pathlib, sys
from kvsieve.eval.store import load_results
for stage in sorted(p for p in pathlib.Path(sys.argv[1]).iterdir() if p.is_dir()):
    rows = collections.Counter((r["method"], r["budget"]) for r in load_results(stage))
    print(stage.name, ", ".join(f"{m}@{b}: {n}" for (m, b), n in rows.items()) or "no rows")
PY
    ;;
  *) echo "usage: $0 pin COMMIT | run [STAGE..] | start [STAGE..] | status" >&2; exit 2 ;;
esac
