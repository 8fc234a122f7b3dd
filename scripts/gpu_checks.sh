#!/usr/bin/env bash
# Every GPU check of the project in one go, on one GPU (CI has none; run by hand):
#   1. alone on the GPU: `megatron-rails bench local --device cuda` for Mixtral 8x7B and 8x22B shapes
#      (bf16, against Megatron-Core's own permute/unpermute), and 8x7B once more with the send order
#      made by torch ops (MEGATRON_RAILS_SEND_ORDER=device: the path where Triton is missing) as a
#      baseline;
#   2. side by side: scripts/gpu_check.py (4 ranks over gloo against the stock alltoall dispatcher),
#      the same with shared experts on their own stream (fsep, ultraep), and
#      scripts/gpu_pretrain_check.sh (Megatron-LM's pretrain_gpt.py: one NCCL rank in three
#      instances, each with its own stock run, and two gloo ranks). Iteration times from step 2 share the GPU and CPUs with the
#      other streams: compare them within a stream only.
#
#   bash scripts/gpu_checks.sh MEGATRON_LM_DIR OUTDIR
#
# First the compiled planner and route parts (C, see setup.py) are built in place for this Python,
# where a checkout has not built them: without them the planners run their numpy definitions and
# the plan times are not the product's. SKIP_BENCH=1 skips step 1; PROFILE=1 adds
# scripts/profile_local.py (Mixtral 8x7B) to it; RUN_TIMEOUT (100 s) limits each pretrain run.
# OUTDIR gets bench JSONs, gpu_check.log, the loss tables and one archive of every log (pretrain.tgz).
set -u
[ $# -eq 2 ] || { echo "usage: bash scripts/gpu_checks.sh MEGATRON_LM_DIR OUTDIR" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$1/pretrain_gpt.py" ] || { echo "gpu_checks: $1/pretrain_gpt.py not found (give a Megatron-LM checkout)" >&2; exit 2; }
MLM=$(cd "$1" && pwd)
mkdir -p "$2" && OUT=$(cd "$2" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO:$MLM${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
cd "$REPO"
say() { echo "[gpu_checks $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

"$PY" setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1
built=$?
if [ $built != 0 ]; then  # e.g. a setuptools older than pyproject.toml needs: the C files alone
  ext=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  for c in megatron_rails/core/_route_c.c megatron_rails/core/planners/_ultraep_c.c megatron_rails/core/planners/_fsep_c.c \
           megatron_rails/core/planners/_flow_c.c; do
    cc -O3 -std=c11 -shared -fPIC -I"$inc" "$c" -o "${c%.c}$ext" >> "$OUT/build.txt" 2>&1 || built=$?
  done
fi
say "0. compiled parts: build exit $built; $("$PY" -c 'from megatron_rails.core.compiled import compiled as c
parts = [("megatron_rails.core._route_c", "rank_tables"), ("megatron_rails.core.planners._fsep_c", "fsep_layout"),
         ("megatron_rails.core.planners._ultraep_c", "cascade_plan"), ("megatron_rails.core.planners._flow_c", "flow_solve")]
print("in use:", sum(c(m, n) is not None for m, n in parts), "of", len(parts))' 2>&1 | tail -1)"

if [ "${SKIP_BENCH:-0}" = 1 ]; then say "1. bench local: skipped (SKIP_BENCH=1)"; else
say "1. bench local (alone on the GPU)"
for shape in mixtral-8x7b mixtral-8x22b; do
  timeout 180 "$PY" -m megatron_rails.cli bench local --device cuda --shape "$shape" \
    --out "$OUT/local-$shape.json" > "$OUT/local-$shape.txt" 2>&1
  say "  $shape: exit $?"; grep -E "^  [a-z]+ +(uniform|zipf)" "$OUT/local-$shape.txt" | tee -a "$OUT/summary.txt"
  "$PY" -c 'import json, sys; print("  targets met:", json.load(open(sys.argv[1]))["targets"])' \
    "$OUT/local-$shape.json" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
done
MEGATRON_RAILS_SEND_ORDER=device timeout 180 "$PY" -m megatron_rails.cli bench local --device cuda \
  --shape mixtral-8x7b --out "$OUT/local-mixtral-8x7b-device-order.json" > "$OUT/local-device.txt" 2>&1
say "  mixtral-8x7b, send order by torch ops: exit $?"; grep -E "^  [a-z]+ +(uniform|zipf)" "$OUT/local-device.txt" | tee -a "$OUT/summary.txt"
if [ "${PROFILE:-0}" = 1 ]; then  # where the time goes: kernels, torch ops, Python (OUTDIR/profile.txt)
  timeout 240 "$PY" scripts/profile_local.py --shape mixtral-8x7b --device cuda --reps 20 --out "$OUT" \
    > "$OUT/profile-summary.txt" 2>&1
  say "  profile_local (8x7B): exit $?"; grep -E "^[a-z]+ +(uniform|zipf)" "$OUT/profile-summary.txt" | tee -a "$OUT/summary.txt"
fi
fi

say "2. gpu_check and pretrain_gpt.py, side by side"
SETUP_ONLY=1 bash scripts/gpu_pretrain_check.sh "$MLM" "$OUT/setup" > "$OUT/setup.txt" 2>&1  # helpers built once
say "  pretrain setup: exit $?"; tail -4 "$OUT/setup/env.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
timeout ${CHECK_TIMEOUT:-300} "$PY" scripts/gpu_check.py > "$OUT/gpu_check.log" 2>&1 &
check=$!
timeout ${CHECK_TIMEOUT:-300} "$PY" scripts/gpu_check.py --shared-experts --policies fsep ultraep \
  > "$OUT/gpu_check_shared.log" 2>&1 &
shared=$!
# one rank (NCCL): three instances, each with its own stock run, so the policies' runs overlap (about
# 35 s each on an H200); two ranks over gloo: stock first, the policies only if it gets through
pids=()
for part in "a:none eplb" "b:fsep ultraep" "c:lp"; do
  name=ep1${part%%:*}
  SITE=/tmp/site-$name RUN_TIMEOUT=${RUN_TIMEOUT:-100} WORLDS=1 POLICIES="${part#*:}" \
    PORT_BASE=$((29400 + 100 * ${#pids[@]})) bash scripts/gpu_pretrain_check.sh "$MLM" "$OUT/$name" > "$OUT/$name.txt" 2>&1 &
  pids+=($!)
done
SITE=/tmp/site-ep2 RUN_TIMEOUT=${RUN_TIMEOUT:-100} WORLDS=2 PORT_BASE=29800 bash scripts/gpu_pretrain_check.sh "$MLM" "$OUT/ep2" \
  > "$OUT/ep2.txt" 2>&1 &
ep2=$!
wait $check; say "gpu_check: exit $?"; grep -v "^\[\|Warning\|warn\|spawn.py" "$OUT/gpu_check.log" | tail -40 | tee -a "$OUT/summary.txt"
wait $shared; say "gpu_check --shared-experts: exit $?"
grep -v "^\[\|Warning\|warn\|spawn.py" "$OUT/gpu_check_shared.log" | tail -14 | tee -a "$OUT/summary.txt"
for i in 0 1 2; do
  name=ep1$(echo a b c | cut -d' ' -f$((i + 1)))
  wait "${pids[$i]}"; say "pretrain, 1 rank (NCCL), $name: exit $?"; cat "$OUT/$name/table.md" >> "$OUT/summary.txt" 2>/dev/null
done
wait $ep2; say "pretrain, 2 ranks (gloo): exit $?"; cat "$OUT/ep2/table.md" >> "$OUT/summary.txt" 2>/dev/null
tar czf "$OUT/pretrain.tgz" -C "$OUT" build.txt setup setup.txt ep1a ep1b ep1c ep2 ep1?.txt ep2.txt local-mixtral-8x7b.txt \
  local-mixtral-8x22b.txt local-device.txt 2>/dev/null
rm -rf "$OUT/build.txt" "$OUT/setup" "$OUT/setup.txt" "$OUT"/ep1? "$OUT/ep2" "$OUT"/ep*.txt "$OUT"/local-*.txt
say "done"
