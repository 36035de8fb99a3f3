#!/usr/bin/env bash
# Issue 35's accuracy grid: Qwen2.5-Coder-1.5B (bundled, fp32, greedy), every cell from one pinned commit.
#
#   scripts/accuracy_grid.sh pin COMMIT     record the commit the grid runs (results/accuracy-grid/PIN)
#   scripts/accuracy_grid.sh pin-tri COMMIT record the commit stages 4 and 5 (TriAttention, issue 34) run (PIN-triattention)
#   scripts/accuracy_grid.sh pin-official COMMIT, pin-official-tri COMMIT: the same for stages 6-7 and 8-9
#   scripts/accuracy_grid.sh run [STAGE..]  resume the stages (default: 1 2), nice'd, in the foreground
#   scripts/accuracy_grid.sh start [STAGE..] the same under nohup in the background (log: results/accuracy-grid/grid.log)
#   scripts/accuracy_grid.sh status         whether it runs; per stage, cells and rows done and the cells to come
#   scripts/accuracy_grid.sh report [ARG..] report.md, summary.csv and plots of each stage (stage 4's cells
#                                           joined to stage 1's, stage 5's to stage 2's); ARGs go to
#                                           `kvsieve report` (--common, --no-plots)
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
#   2  MATH-500 problems 100-149, budget 256, 768 new tokens: the 11 methods, and the four seed methods
#      with their prompt protected: stage 1 found that keeping the prompt moves accuracy more than the
#      scorer at budget 128, where GSM8K's prompts (111 tokens on average) nearly fill the budget; these
#      prompts average 122 tokens against a budget of 256, so the cells show whether that holds there
#   3  GSM8K test 0-99, budget 64, 512 new tokens: the five seed methods and random
#   4  TriAttention (issue 34) at stage 1's problems, budget and length, from its own pinned commit
#      (PIN-triattention; the golden test shows nothing else changed since PIN), with the statistics
#      of results/triattention/ (kvsieve calibrate triattention on GSM8K-train), and SnapKV, the
#      other baseline of its paper (R-KV is in stage 1), with its prompt kept as TriAttention's and
#      rkv's are (snapkv's default lets it compete; at budget 128 that alone moves accuracy, see
#      stage 1's +protect cells); its rows join stage 1's report (accuracy_grid.sh report)
#   5  TriAttention at stage 2's problems, budget and length, from stage 4's pin, with the same statistics
#      (calibrated on GSM8K-train: its transfer to MATH-500 is part of what this cell shows); its rows join
#      stage 2's report. Run after stage 2: scripts/accuracy_grid.sh start 1 2 5
#   6  Issue 51's official defaults at stage 1's problems, budget and length, from their own pin
#      (PIN-official): R-KV as its official code runs it (prompt compressed at prefill and competing,
#      lambda 0.07, the group max of logits over the keys before the window), labelled rkv+official; full on 10 samples only
#      (--reference-limit: the report joins these rows to stage 1's, whose full is the reference, and
#      checks that full decodes the same 10 texts at both pins); rows stop at an invented next turn
#   7  the same at stage 2's problems, budget and length (joins stage 2's report)
#   8  Issue 51's official TriAttention at stage 1's problems, budget and length, from their own pin
#      (PIN-official-tri), with stage 4's statistics: the paper's runner's semantics, the default since
#      issue 51 (per_head: each kv head keeps the same tokens in every layer; the prompt pinned inside the
#      budget; no recent window; the z-score over generated tokens), spelled out, labelled
#      triattention+official; full on 10 samples (joins stage 1's report, as stage 6)
#   9  the same at stage 2's problems, budget and length (joins stage 2's report): TriAttention on
#      MATH-500, which stage 5 (kvsieve's earlier reading, never run) was to give
#
# Settings that are not a method's default, each the setting of the comparison its paper makes:
#   tova      prefill_block=true: CAOTE compares with its bases under block-wise prefill (Table 10)
#   h2o       recent=W (LazyEviction App. C: H2O's recent window equals LazyEviction's W)
#   lazy      W = 25 on GSM8K (its default), W = 52 on MATH-500: the paper's best W per dataset (App. G.1,
#             Table 9: GSM8K 80.06 at W=25, MATH-500 75.2 at W=52, both at r = 50%); h2o's recent follows it
#   lagkv     L=128, r=1/8: the smallest setting of Sec. 3.1's grid (no grid setting fits budget 128 at
#             these lengths); one cell without a budget, placed by its measured peak KV
# Everything else runs at its defaults (AMS and Expected: interval capped at
# budget // 2 by the policy).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GRID=results/accuracy-grid
GRID_TREE=${GRID_TREE:-$ROOT/../kvsieve-grid-tree}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TRI_STATS=${TRI_STATS:-$ROOT/results/triattention/qwen2.5-coder-1.5b-stats.pt}
# The statistics stage 4 used (sha256 417c167c...369e), as tracked before 5a4b4e1 untracked them: stage 5
# must use the same file, and a fresh calibration differs from it in the last float bits (summation
# order follows the thread count: 2e-6 at most on values up to 41, measured 2026-11-26)
TRI_STATS_BLOB=5a4b4e1^:results/triattention/qwen2.5-coder-1.5b-stats.pt
BATCH=${BATCH:-50}
THREADS=${THREADS:-2}

# The order of --methods is the order cells run in, and changes nothing else (run.json's settings are a
# mapping): rkv first after full (stage 4's TriAttention is reported beside it, its paper's baseline),
# random before the other baselines (the control every cell is paired with), and at both stages the
# prompt-protected cells before h2o and expected (the README's "when to protect the prompt"; stage 2
# ran them after h2o and expected until 2026-11-26, when the answer waited on them)
CORE=full,rkv,lazy,ams:tova,skipkv,caote:tova,lagkv,tova,random
BASELINES=h2o,expected
SEED_PROTECTED=lazy+protect,ams:tova+protect,skipkv+protect,caote:tova+protect
PROTECTED=$SEED_PROTECTED,rkv+competes
# --set flags per group of methods: eval refuses a setting for a method not in its --methods, so
# each stage passes the settings of its own methods only
LAGKV_SET="--set lagkv.lag=128 --set lagkv.ratio=0.125"
BASE_SET="--set tova.prefill_block=true --set h2o.recent_rule=lazy-window $LAGKV_SET"
SEED_PROTECT_SET="--set lazy+protect.protect_prompt=true --set ams:tova+protect.protect_prompt=true
                  --set skipkv+protect.protect_prompt=true --set caote:tova+protect.protect_prompt=true"
PROTECT_SET="$SEED_PROTECT_SET --set rkv+competes.protect_prompt=false"
MATH_SET="--set tova.prefill_block=true --set lazy.window=52 --set lazy+protect.window=52 --set h2o.recent=52
          $LAGKV_SET $SEED_PROTECT_SET"

# Issue 51's R-KV defaults, spelled out so that run.json names them (rkv and rkv+competes of stages 1 and 2
# ran R-KV's defaults before issue 51: prompt kept, lambda 0.1, the group mean of probabilities over all keys)
OFFICIAL_SET="--set rkv+official.protect_prompt=false --set rkv+official.mix_lambda=0.07
              --set rkv+official.head_reduction=max-logits --set rkv+official.window_keys=false"
# Issue 51's TriAttention defaults, spelled out the same way (stage 4 ran kvsieve's earlier reading: prompt kept
# outside the budget, a recent window of min(128, B/2), each (layer, kv head) on its own, z over live tokens)
TRI_OFFICIAL_SET="--set triattention+official.stats=$TRI_STATS --set triattention+official.pruning=per_head
                  --set triattention+official.pin_prompt=true --set triattention+official.protect_prompt=false
                  --set triattention+official.recent=0 --set triattention+official.normalize_over=decode"

stage_args() {  # stage -> its eval arguments
  case $1 in
    1) echo "--dataset gsm8k --data ../shared/data/gsm8k_test.jsonl --limit 100 --budgets 128 --max-new-tokens 512
             --methods $CORE,$PROTECTED,$BASELINES $BASE_SET $PROTECT_SET --out $GRID/stage1-gsm8k-b128" ;;
    2) echo "--dataset math500 --data ../shared/data/math500.jsonl --skip 100 --limit 50 --budgets 256
             --max-new-tokens 768 --methods $CORE,$SEED_PROTECTED,$BASELINES $MATH_SET --out $GRID/stage2-math500-b256" ;;
    3) echo "--dataset gsm8k --data ../shared/data/gsm8k_test.jsonl --limit 100 --budgets 64 --max-new-tokens 512
             --methods full,lazy,ams:tova,skipkv,caote:tova,lagkv,random $LAGKV_SET --out $GRID/stage3-gsm8k-b64" ;;
    4) echo "--dataset gsm8k --data ../shared/data/gsm8k_test.jsonl --limit 100 --budgets 128 --max-new-tokens 512
             --methods triattention,snapkv+protect --set triattention.stats=$TRI_STATS
             --set snapkv+protect.protect_prompt=true --out $GRID/stage4-gsm8k-b128-triattention" ;;
    5) echo "--dataset math500 --data ../shared/data/math500.jsonl --skip 100 --limit 50 --budgets 256
             --max-new-tokens 768 --methods triattention --set triattention.stats=$TRI_STATS
             --out $GRID/stage5-math500-b256-triattention" ;;
    6) echo "--dataset gsm8k --data ../shared/data/gsm8k_test.jsonl --limit 100 --budgets 128 --max-new-tokens 512
             --methods rkv+official $OFFICIAL_SET --reference-limit 10 --out $GRID/stage6-gsm8k-b128-official" ;;
    7) echo "--dataset math500 --data ../shared/data/math500.jsonl --skip 100 --limit 50 --budgets 256
             --max-new-tokens 768 --methods rkv+official $OFFICIAL_SET --reference-limit 10
             --out $GRID/stage7-math500-b256-official" ;;
    8) echo "--dataset gsm8k --data ../shared/data/gsm8k_test.jsonl --limit 100 --budgets 128 --max-new-tokens 512
             --methods triattention+official $TRI_OFFICIAL_SET --reference-limit 10
             --out $GRID/stage8-gsm8k-b128-triattention-official" ;;
    9) echo "--dataset math500 --data ../shared/data/math500.jsonl --skip 100 --limit 50 --budgets 256
             --max-new-tokens 768 --methods triattention+official $TRI_OFFICIAL_SET --reference-limit 10
             --out $GRID/stage9-math500-b256-triattention-official" ;;
    *) echo "unknown stage $1 (1 to 9)" >&2; return 1 ;;
  esac
}

tri_pinned() {  # stage -> true for the stages that run TriAttention from its own pin (4 and 5)
  [[ $1 == [45] ]]
}

official_pinned() {  # stage -> true for the stages of issue 51's official R-KV (6 and 7)
  [[ $1 == [67] ]]
}

official_tri_pinned() {  # stage -> true for the stages of issue 51's official TriAttention (8 and 9)
  [[ $1 == [89] ]]
}

pin_of() {  # stage -> the file holding its pinned commit
  if tri_pinned "$1"; then echo "$GRID/PIN-triattention"
  elif official_pinned "$1"; then echo "$GRID/PIN-official"
  elif official_tri_pinned "$1"; then echo "$GRID/PIN-official-tri"
  else echo "$GRID/PIN"; fi
}

tree_of() {  # stage -> the worktree it runs from
  if tri_pinned "$1"; then echo "$GRID_TREE-triattention"
  elif official_pinned "$1"; then echo "$GRID_TREE-official"
  elif official_tri_pinned "$1"; then echo "$GRID_TREE-official-tri"
  else echo "$GRID_TREE"; fi
}

tree() {  # stage -> its pinned worktree, made on first use
  local pin_file tree pin
  pin_file=$(pin_of "$1")
  tree=$(tree_of "$1")
  [[ -f $pin_file ]] || { echo "no pinned commit in $pin_file: scripts/accuracy_grid.sh pin COMMIT (or pin-tri)" >&2; exit 1; }
  pin=$(cat "$pin_file")
  if [[ ! -d $tree ]]; then
    git worktree prune
    git worktree add --detach "$tree" "$pin" >&2
  fi
  [[ $(git -C "$tree" rev-parse HEAD) == "$pin" ]] || { echo "$tree is not at $pin" >&2; exit 1; }
}

run_stage() {
  local args
  args=$(stage_args "$1")
  tree "$1"
  if (tri_pinned "$1" || official_tri_pinned "$1") && [[ ! -f $TRI_STATS ]]; then  # restored from history, else calibrated
    mkdir -p "$(dirname "$TRI_STATS")"
    if git cat-file -e "$TRI_STATS_BLOB" 2>/dev/null; then
      git cat-file blob "$TRI_STATS_BLOB" > "$TRI_STATS"
    else
      PYTHONPATH=$(tree_of "$1")/src OMP_NUM_THREADS=$THREADS nice -n 10 "$PYTHON" -m kvsieve.cli calibrate triattention \
        --model qwen2.5-coder-1.5b --data ../shared/data/gsm8k_train.jsonl --out "$TRI_STATS"
    fi
  fi
  echo "$(date -u +%FT%TZ) stage $1: start"
  # shellcheck disable=SC2086  # stage_args is a word list
  PYTHONPATH=$(tree_of "$1")/src OMP_NUM_THREADS=$THREADS nice -n 10 "$PYTHON" -m kvsieve.eval eval \
    --model qwen2.5-coder-1.5b $args --batch-size "$BATCH" --pin-commit --no-progress
  echo "$(date -u +%FT%TZ) stage $1: done"
}

report_stage() {  # stage dir, the dirs whose cells join it (space-separated, or ""), report args
  local dir=$1 joined=$2 join=()
  shift 2
  [[ -d $dir ]] || return 0
  for j in $joined; do  # a joined stage that has not written a row yet (a stage just started) is left out
    compgen -G "$j/results*.jsonl" > /dev/null && [[ -n $(cat "$j"/results*.jsonl | head -c 1) ]] && join+=(--join "$j")
  done
  "$PYTHON" -m kvsieve.eval report "$dir" "${join[@]}" "$@"
}

case ${1:-run} in
  pin)
    [[ -n ${2:-} ]] || { echo "usage: $0 pin COMMIT" >&2; exit 2; }
    mkdir -p $GRID && git rev-parse --verify "$2^{commit}" > $GRID/PIN && cat $GRID/PIN ;;
  pin-official)
    [[ -n ${2:-} ]] || { echo "usage: $0 pin-official COMMIT" >&2; exit 2; }
    mkdir -p $GRID && git rev-parse --verify "$2^{commit}" > $GRID/PIN-official && cat $GRID/PIN-official ;;
  pin-official-tri)
    [[ -n ${2:-} ]] || { echo "usage: $0 pin-official-tri COMMIT" >&2; exit 2; }
    mkdir -p $GRID && git rev-parse --verify "$2^{commit}" > $GRID/PIN-official-tri && cat $GRID/PIN-official-tri ;;
  pin-tri)
    [[ -n ${2:-} ]] || { echo "usage: $0 pin-tri COMMIT" >&2; exit 2; }
    mkdir -p $GRID && git rev-parse --verify "$2^{commit}" > $GRID/PIN-triattention && cat $GRID/PIN-triattention ;;
  run)
    shift || true
    for stage in "${@:-1 2}"; do for s in $stage; do run_stage "$s"; done; done ;;
  start)
    shift || true
    for stage in "${@:-1 2}"; do for s in $stage; do tree "$s"; done; done  # fail now, not in the background
    mkdir -p $GRID
    nohup "$0" run "$@" >> $GRID/grid.log 2>&1 &
    echo "started (pid $!); follow it with: tail -f $GRID/grid.log" ;;
  status)
    if pgrep -f "accuracy_grid.sh run" > /dev/null; then echo "running (log: $GRID/grid.log)"; else echo "not running"; fi
    for pid in $(pgrep -f "kvsieve.eval eval"); do  # a results file removed under a running grid takes its rows with it
      if ls -l "/proc/$pid/fd" 2>/dev/null | grep -q "results.*(deleted)"; then
        echo "WARNING: eval $pid writes to a deleted results file (stashed or cleaned?): copy /proc/$pid/fd/N back before it ends"
      fi
    done
    for s in 1 2 3 4 5 6 7 8 9; do
      # shellcheck disable=SC2046  # stage_args is a word list
      "$PYTHON" - "$s" $(stage_args "$s") <<'PY'
import collections, pathlib, sys
from kvsieve.eval.store import load_results
stage, args = sys.argv[1], sys.argv[2:]
arg = lambda flag: args[args.index(flag) + 1]
out, limit = pathlib.Path(arg("--out")), int(arg("--limit"))
methods = ["full"] + [m for m in arg("--methods").split(",") if m != "full"]  # eval adds full
rows = collections.Counter(r["method"] for r in load_results(out)) if out.is_dir() else collections.Counter()
ref = int(arg("--reference-limit")) if "--reference-limit" in args else limit  # full's samples
want = {m: min(limit, ref) if m == "full" else limit for m in methods}
done = sum(min(rows[m], want[m]) for m in methods)
cells = sum(rows[m] >= want[m] for m in methods)
todo = [m for m in methods if rows[m] < want[m]]
print(f"stage {stage} ({out.name}): {cells}/{len(methods)} cells, {done}/{sum(want.values())} rows"
      + (f"; next: {', '.join(f'{m} ({rows[m]}/{want[m]})' for m in todo)}" if todo else "; complete"))
PY
    done ;;
  report)
    shift || true
    report_stage "$GRID/stage1-gsm8k-b128" "$GRID/stage4-gsm8k-b128-triattention $GRID/stage6-gsm8k-b128-official
      $GRID/stage8-gsm8k-b128-triattention-official" "$@"
    report_stage "$GRID/stage2-math500-b256" "$GRID/stage7-math500-b256-official
      $GRID/stage9-math500-b256-triattention-official" "$@"  # stage 5 never ran: superseded by 9
    report_stage "$GRID/stage3-gsm8k-b64" "" "$@"
    # the README's and docs/results.md's tables and figures, from the new summary.csv and report.md
    "$PYTHON" scripts/grid_docs.py ;;
  *) echo "usage: $0 pin COMMIT | pin-tri COMMIT | pin-official COMMIT | pin-official-tri COMMIT | run [STAGE..] | start [STAGE..] | status | report [ARG..]" >&2
     exit 2 ;;
esac
