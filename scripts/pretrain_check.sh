#!/usr/bin/env bash
# Run Megatron-LM's own pretrain_gpt.py through the megatron-rails launcher (docs/megatron-lm.md,
# launcher route): a small MoE GPT (4 layers, hidden 512; on CPU 2 layers, hidden 128; 8 experts top-2,
# alltoall dispatcher, mock data, fp32), stock and with --moe-balancer none/eplb/fsep/ultraep/lp, then compare every run's lm loss
# with the stock run of its group. Entry points: scripts/gpu_pretrain_check.sh (DEVICE=cuda) and
# scripts/cpu_pretrain_check.sh (DEVICE=cpu).
#
#   DEVICE=cuda|cpu bash scripts/pretrain_check.sh MEGATRON_LM_DIR [OUTDIR]
#
# Groups (RUN_GROUPS; a group's runs are compared with its stock run):
#   ep1        one rank (cuda: NCCL; cpu: gloo)
#   ep2, ep4   2 / 4 ranks, gloo, expert parallelism over all of them (cuda: all on the one GPU, through
#              scripts/megatron_lm_gloo.py: Megatron DDP's coalesced bucket collectives one by one)
#   ep2dist    ep2 with --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
#   ep4rails   ep4 with every policy over RailS on 2 virtual nodes of 2 ranks (rails_tolerance 0: it
#              always sprays; dedup on), from a policy file written to OUTDIR
#   ep2pp2     4 ranks: 2 pipeline stages of 2 expert-parallel ranks, each stage two interleaved virtual
#              stages of one layer (the microbatches of an iteration interleave)
#   ep2ckpt    checkpoints in Megatron-LM's default format (torch_dist), saved at ITERS/2 and resumed:
#              stock saves and resumes (the reference); <policy>_saves: the policy saves, stock resumes;
#              <policy>_loads: the policy resumes from stock's checkpoint
# DEVICE=cpu runs scripts/megatron_lm_cpu.py (CUDA placements answered by the CPU); there the stock run of
# a group with expert parallelism uses Megatron's allgather dispatcher (its alltoall one cannot run on
# several CPU ranks: see that file), on CUDA the alltoall dispatcher the policies replace.
#
# Each run's full log goes to OUTDIR/<name>.log (its command line to OUTDIR/<name>.cmd, its exit status
# to OUTDIR/<name>.rc); a failing run never stops the script (but a failed multi-rank stock run skips
# that group's policy runs, which would have nothing to compare with, unless GLOO_RUN_ALL=1). Then
# scripts/pretrain_loss_table.py OUTDIR compares every run's per-iteration lm loss with the stock run of
# its group (OUTDIR/table.md; with DEVICE=cpu every failed run is a problem: --strict).
#
# Environment knobs: DEVICE (cuda), RUN_GROUPS (cuda: "ep1 ep2", or from WORLDS "1 2"; cpu: "ep2 ep2dist
# ep4rails ep2pp2 ep2ckpt"), POLICIES ("none eplb fsep ultraep lp", cpu: and "default", the shipped default config),
# ITERS (cuda 50, cpu 20), ACCUM (microbatches per iteration: cuda 1, cpu 4; a pipeline group takes
# the next multiple of its stages), EXTRA_ARGS (appended to
# every run's arguments), PYTHON (python3), RUN_TIMEOUT (150 s per run; cpu 600),
# DETERMINISTIC (1: --deterministic-mode), PRINT_ONLY=1 (print each run's command line and exit), SITE
# (/tmp/gpu_check_site: where wheels carried in .whl/ are unpacked; cuda only), PORT_BASE (29400), SETUP_ONLY=1
# (unpack, build Megatron's dataset helpers, then exit: before instances run side by side),
# GLOO_RUN_ALL=1 (run a group's policy runs even when its stock run failed), PRETRAIN_UNCOALESCED=1 (cpu:
# Megatron DDP's bucket collectives one by one, as scripts/megatron_lm_gloo.py has them on a GPU).
set -u

DEVICE=${DEVICE:-cuda}
NAME=${CHECK_NAME:-pretrain_check}
usage() { echo "usage: bash scripts/$NAME.sh MEGATRON_LM_DIR [OUTDIR]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
[ -f "$1/pretrain_gpt.py" ] || { echo "$NAME: $1/pretrain_gpt.py not found" >&2; usage; }
case $DEVICE in cuda|cpu) ;; *) echo "$NAME: DEVICE=$DEVICE: cuda or cpu" >&2; exit 2;; esac

REPO=$(cd "$(dirname "$0")/.." && pwd)
MLM=$(cd "$1" && pwd)
OUT=${2:-${DEVICE/cuda/gpu}_pretrain_out}
mkdir -p "$OUT/traces" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
if [ "$DEVICE" = cpu ]; then
  ITERS=${ITERS:-20}; RUN_TIMEOUT=${RUN_TIMEOUT:-600}; ACCUM=${ACCUM:-4}
  POLICIES=${POLICIES:-"none eplb fsep ultraep lp default"}
  RUN_GROUPS=${RUN_GROUPS:-"ep2 ep2dist ep4rails ep2pp2 ep2ckpt"}
else
  ITERS=${ITERS:-50}; RUN_TIMEOUT=${RUN_TIMEOUT:-150}; ACCUM=${ACCUM:-1}
  POLICIES=${POLICIES:-"none eplb fsep ultraep lp"}
  RUN_GROUPS=${RUN_GROUPS:-$(for w in ${WORLDS:-1 2}; do printf 'ep%s ' "$w"; done)}
fi
DETERMINISTIC=${DETERMINISTIC:-1}
PRINT_ONLY=${PRINT_ONLY:-0}
SITE=${SITE:-/tmp/gpu_check_site}
MICRO=4

log() {  # under PRINT_ONLY=1 to stderr only: stdout is one command line per run
  if [ "$PRINT_ONLY" = 1 ]; then echo "[$NAME $(date +%H:%M:%S)] $*" >&2; return; fi
  echo "[$NAME $(date +%H:%M:%S)] $*" | tee -a "$OUT/script.log"
}

# -- the model and training arguments (the same for every run) -------------------------------------------
# the model: on CPU a smaller one (one core per rank: a step of the GPU's model takes ~10 s there)
if [ "$DEVICE" = cpu ]; then
  SEQ=128
  MODEL=(--num-layers 2 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4
         --seq-length $SEQ --max-position-embeddings $SEQ)
else
  SEQ=256
  MODEL=(--num-layers 4 --hidden-size 512 --ffn-hidden-size 1024 --num-attention-heads 8
         --seq-length $SEQ --max-position-embeddings $SEQ)
fi
COMMON=(
  "${MODEL[@]}"
  --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --micro-batch-size $MICRO --train-iters "$ITERS" --log-interval 1
  --lr 1e-4 --lr-decay-style constant --lr-warmup-iters 0 --seed 1234
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --num-workers 0
  --eval-iters 0 --eval-interval 1000000
  --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion
  --no-persist-layer-norm --disable-bias-linear
)
# EXTRA_ARGS: more Megatron-LM arguments for every run (e.g. "--clip-grad 0.0")
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
COMMON+=(${EXTRA[@]+"${EXTRA[@]}"})

# -- run one configuration -----------------------------------------------------------------------------
PORT=${PORT_BASE:-29400}  # PORT_BASE: two instances side by side need apart ports
run_one() {  # NAME WORLD EP [EXTRA ARGS...]
  local name=$1 world=$2 ep=$3; shift 3
  local backend=gloo extra=() entry=(-m megatron_rails.launch)
  # --deterministic-mode (torch.use_deterministic_algorithms); RUN_DET=0 turns it off for one run
  [ "${RUN_DET:-$DETERMINISTIC}" = 1 ] && extra+=(--deterministic-mode)
  if [ "$DEVICE" = cpu ]; then
    entry=("$REPO/scripts/megatron_lm_cpu.py")
  elif [ "$world" = 1 ]; then
    backend=nccl
  else
    # all ranks on cuda:0: Megatron-LM core_v0.16 does torch.cuda.set_device(args.local_rank), and
    # --local-rank defaults to $LOCAL_RANK (1 on the second rank): pass 0 explicitly. NCCL refuses two
    # ranks on one GPU, hence gloo, and gloo has no CUDA coalesced all-reduce, which Megatron DDP
    # issues per bucket group: scripts/megatron_lm_gloo.py issues those collectives one by one
    extra+=(--local-rank 0); entry=("$REPO/scripts/megatron_lm_gloo.py")
  fi
  PORT=$((PORT + 1))
  # the dense layers' data-parallel size is world / pipeline stages = ep (no tensor parallelism)
  local cmd=(timeout -k 15 "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node "$world"
             --master-addr 127.0.0.1 --master-port "$PORT"
             "${entry[@]}" "$MLM/pretrain_gpt.py" "${COMMON[@]}"
             --global-batch-size $((MICRO * ep * ${accum:-$ACCUM})) --distributed-backend "$backend"
             --expert-model-parallel-size "$ep" ${extra[@]+"${extra[@]}"} "$@")
  if [ "$PRINT_ONLY" = 1 ]; then
    printf '%s' "$name"; printf ' %q' "${cmd[@]}"; printf '\n'
    return 0
  fi
  printf '%q ' "${cmd[@]}" > "$OUT/$name.cmd"; echo >> "$OUT/$name.cmd"
  log "run $name (world $world, $backend): ${*:-stock}"
  local t0=$SECONDS rc
  "${cmd[@]}" > "$OUT/$name.log" 2>&1 < /dev/null
  rc=$?
  echo "$rc" > "$OUT/$name.rc"
  log "  $name: exit $rc after $((SECONDS - t0)) s; $(grep -c ' iteration .*lm loss' "$OUT/$name.log") iterations logged"
  if [ "$rc" != 0 ]; then
    grep -E 'Error|error:|Traceback|Killed|Exception' "$OUT/$name.log" | grep -v Warning | tail -3 | sed 's/^/    /' \
      | tee -a "$OUT/script.log"
  fi
  if [ "$rc" != 0 ] && [ "${RUN_DET:-$DETERMINISTIC}" = 1 ] \
      && grep -q "does not have a deterministic implementation" "$OUT/$name.log"; then
    # an op without a deterministic CUDA kernel: keep that log, run again without --deterministic-mode
    mv "$OUT/$name.log" "$OUT/$name.deterministic-error.txt"
    log "  $name: no deterministic kernel for an op ($(grep -m1 -o '[A-Za-z_.]* does not have a deterministic implementation' "$OUT/$name.deterministic-error.txt")); again without --deterministic-mode"
    RUN_DET=0 run_one "$name" "$world" "$ep" "$@"
    return $?
  fi
  return "$rc"
}

if [ "$PRINT_ONLY" != 1 ]; then
  : > "$OUT/script.log"
  log "repo $REPO, Megatron-LM $MLM, out $OUT, $ITERS iterations, timeout $RUN_TIMEOUT s per run"

  # -- Python path: megatron_rails from the repo, megatron.core/.training from the checkout --------------
  # (wheels carried to a GPU machine for its Python; on CPU this Python's own packages serve)
  if [ "$DEVICE" = cuda ] && compgen -G "$REPO/.whl/*.whl" > /dev/null; then
    mkdir -p "$SITE"
    # A wheel is a zip: unpacking it is what `pip install --no-deps --target` does (no pip needed). Only the
    # modules this Python lacks, since $SITE comes before site-packages; typing_extensions always (pydantic
    # 2.14 needs >= 4.16, and a newer one serves torch as well).
    "$PY" - "$SITE" "$REPO"/.whl/*.whl <<'PYEOF' 2>&1 | tee -a "$OUT/script.log"
import importlib.util, os, sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    module = os.path.basename(wheel).split("-")[0]
    if module != "typing_extensions" and importlib.util.find_spec(module) is not None:
        print(f"  {module}: already importable, {os.path.basename(wheel)} not used")
        continue
    zipfile.ZipFile(wheel).extractall(site)
    print(f"  {module}: unpacked {os.path.basename(wheel)}")
PYEOF
  fi
  site=""; [ "$DEVICE" = cuda ] && site=":$SITE"   # the unpacked wheels: on CPU this Python's own packages
  export PYTHONPATH="$REPO:$MLM${PYTHONPATH:+:$PYTHONPATH}$site"
  export MEGATRON_LM_DIR="$MLM"
  export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_ALGO=Ring CUDA_DEVICE_MAX_CONNECTIONS=1
  # on CPU one thread per rank: the ranks share the machine's cores
  threads=4; [ "$DEVICE" = cpu ] && threads=1
  export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} TORCH_NCCL_ASYNC_ERROR_HANDLING=1

  {
    echo "== environment"; date; hostname; "$PY" -V; nvidia-smi -L 2>&1 | head -4
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1
    "$PY" -c 'import megatron.core, megatron.training, megatron_rails; print("megatron.core", megatron.core.__file__); print("megatron_rails", megatron_rails.__file__)' 2>&1 | tail -3
    (cd "$MLM" && git describe --tags 2>/dev/null)
    command -v make g++ nvcc python3-config 2>&1
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt" >> "$OUT/script.log"

  # -- Megatron's dataset helpers, compiled once --------------------------------------------------------
  # initialize_megatron runs `make -C megatron/core/datasets` on rank 0; its Makefile names the library
  # helpers_cpp$(python3-config --extension-suffix). python3-config may be missing or belong to another
  # Python: build the one this Python imports, and copy it under the name make will ask for.
  DS="$MLM/megatron/core/datasets"
  EXT=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  MAKE_EXT=$(python3-config --extension-suffix 2>/dev/null || true)
  if [ ! -f "$DS/helpers_cpp$EXT" ] || [ "$DS/helpers.cpp" -nt "$DS/helpers_cpp$EXT" ]; then
    log "compiling $DS/helpers_cpp$EXT"
    "$PY" -m pybind11 --includes > /dev/null 2>&1 || log "pybind11 is not importable: pip install pybind11"
    g++ -O3 -Wall -shared -std=c++17 -fPIC $("$PY" -m pybind11 --includes) "$DS/helpers.cpp" \
      -o "$DS/helpers_cpp$EXT" 2>&1 | tail -5 | tee -a "$OUT/script.log"
  fi
  if [ -f "$DS/helpers_cpp$EXT" ] && [ "helpers_cpp$MAKE_EXT" != "helpers_cpp$EXT" ]; then
    cp -p "$DS/helpers_cpp$EXT" "$DS/helpers_cpp$MAKE_EXT"   # make then finds its target up to date
  fi
  "$PY" -c "import sys; sys.path.insert(0, '$DS'); import helpers_cpp; print('helpers_cpp ok', helpers_cpp.__file__)" \
    2>&1 | tail -1 | tee -a "$OUT/script.log"
  SHIM=$OUT/.shim; mkdir -p "$SHIM"
  if ! command -v make > /dev/null; then   # nothing left for make to do: a no-op stands in
    printf '#!/bin/sh\nexit 0\n' > "$SHIM/make"; chmod +x "$SHIM/make"; export PATH="$SHIM:$PATH"
    log "make not found: a no-op make stands in (helpers_cpp is built)"
  fi
  # megatron.legacy.fused_kernels.load() (run by initialize_megatron) calls $CUDA_HOME/bin/nvcc -V and
  # builds nothing else; without nvcc, a stand-in answers the version (on CPU the load is skipped).
  if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import subprocess; from torch.utils import cpp_extension as c; subprocess.check_output([c.CUDA_HOME + "/bin/nvcc", "-V"])' \
      > /dev/null 2>&1; then
    mkdir -p "$SHIM/cuda/bin"
    printf '#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.0"\n' > "$SHIM/cuda/bin/nvcc"
    chmod +x "$SHIM/cuda/bin/nvcc"; export CUDA_HOME="$SHIM/cuda"
    log "no nvcc under torch's CUDA_HOME: a stand-in nvcc -V at $CUDA_HOME"
  fi
fi

[ "${SETUP_ONLY:-0}" = 1 ] && { log "setup done (SETUP_ONLY=1: no runs)"; exit 0; }

# -- the runs ------------------------------------------------------------------------------------------
group_size() {  # GROUP KIND -> the number after KIND in the group's name (ep2pp2: ep 2, pp 2), else 1
  local rest=${1#*"$2"}
  [ "$rest" = "$1" ] && { echo 1; return; }
  rest=${rest%%[!0-9]*}; echo "${rest:-0}"
}
set_group_args() {  # GROUP -> gargs: the Megatron-LM arguments of every run in the group
  gargs=()
  if [[ $1 == *dist* ]]; then
    gargs+=(--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
  fi
  if [[ $1 == *pp* ]]; then  # pipeline stages of two interleaved virtual stages of one layer each
    local pp; pp=$(group_size "$1" pp)
    gargs+=(--pipeline-model-parallel-size "$pp" --num-layers $((2 * pp)) --num-layers-per-virtual-pipeline-stage 1)
  fi
}
set_policy_args() {  # GROUP POLICY -> pargs: the megatron-rails flags of that run
  local group=$1 policy=$2 file
  if [[ $group == *rails* ]]; then
    # RailS on 2 virtual nodes (ranks_per_node = half the group), spraying at any imbalance, dedup on
    file=$OUT/policy-$group-$policy.yaml
    printf 'policy: %s\ncomm: rails\nranks_per_node: %s\nrails_tolerance: 0\ndedup: true\n' \
      "$policy" $(( $(group_size "$group" ep) / 2 )) > "$file"
    pargs=(--rails-config "$file")
  elif [ "$policy" = default ]; then
    # the default's runs also record their routing (--rails-trace; checked after the loss table)
    pargs=(--rails-config "$REPO/megatron_rails/presets/policies/default.yaml"
           --rails-trace "$OUT/traces/$group-default.npz")
  else
    pargs=(--moe-balancer "$policy")
  fi
}
group_policies() {  # GROUP -> the policies its runs use (over RailS the shipped default is the fsep run)
  local policy
  for policy in $POLICIES; do
    [[ $1 == *rails* && $policy == default ]] || printf '%s ' "$policy"
  done
}
mark_skipped() {  # GROUP: its stock run failed; a marker for each run that is not made
  local group=$1 policy names
  for policy in $(group_policies "$group"); do
    names=("$group-$policy")
    [[ $group == *ckpt* ]] && names=("$group-${policy}_saves" "$group-${policy}_loads")
    for name in "${names[@]}"; do
      echo "skipped: $group-stock failed (see $group-stock.log)" > "$OUT/$name.log"
      echo skipped > "$OUT/$name.rc"
    done
  done
  log "$group-stock failed: the $group policy runs are skipped (GLOO_RUN_ALL=1 runs them anyway)"
}
run_resumed() {  # NAME WORLD EP: ${first[@]} to iteration ITERS/2 (saving), then ${second[@]} to ITERS
  local name=$1 world=$2 ep=$3 rc=0
  mkdir -p "$OUT/phases"
  run_one "phases/$name.1" "$world" "$ep" "${first[@]}" || rc=$?
  if [ "$rc" = 0 ] || [ "$PRINT_ONLY" = 1 ]; then
    run_one "phases/$name.2" "$world" "$ep" "${second[@]}" || rc=$?
  else
    echo "skipped: phases/$name.1 failed (exit $rc): nothing saved to resume from" > "$OUT/phases/$name.2.log"
  fi
  [ "$PRINT_ONLY" = 1 ] && return 0
  cat "$OUT/phases/$name.1.log" "$OUT/phases/$name.2.log" > "$OUT/$name.log"
  echo "$rc" > "$OUT/$name.rc"
  return "$rc"
}
check_checkpoints() {  # GROUP WORLD EP: checkpoints (Megatron-LM's default format, torch_dist) across policies
  # stock: to ITERS/2, saved, resumed to ITERS (the reference); <policy>_saves: the policy to ITERS/2,
  # saved, stock resumes from its checkpoint; <policy>_loads: the policy resumes from stock's checkpoint.
  # Equal losses: the policy saves and loads the stock layout and values (fsep holds only shards). A
  # resume that finds no checkpoint exits (--exit-on-missing-checkpoint) instead of training afresh.
  local group=$1 world=$2 ep=$3 half=$((ITERS / 2)) policy
  if [ "$half" -lt 1 ]; then
    log "group $group: ITERS=$ITERS leaves no iteration to save at (ITERS / 2 = 0): skipped"; return
  fi
  [ "$PRINT_ONLY" = 1 ] || rm -rf "$OUT/ckpt"   # no checkpoint of an earlier run may be resumed
  local save=(--save-interval "$half" --exit-interval "$half") load=(--exit-on-missing-checkpoint --load)
  first=(${gargs[@]+"${gargs[@]}"} ${stock[@]+"${stock[@]}"} --save "$OUT/ckpt/stock" "${save[@]}")
  second=(${gargs[@]+"${gargs[@]}"} ${stock[@]+"${stock[@]}"} "${load[@]}" "$OUT/ckpt/stock")
  if ! run_resumed "$group-stock" "$world" "$ep" && [ "${GLOO_RUN_ALL:-0}" != 1 ]; then
    mark_skipped "$group"; return
  fi
  for policy in $(group_policies "$group"); do
    set_policy_args "$group" "$policy"
    first=(${gargs[@]+"${gargs[@]}"} "${pargs[@]}" --save "$OUT/ckpt/$policy" "${save[@]}")
    second=(${gargs[@]+"${gargs[@]}"} ${stock[@]+"${stock[@]}"} "${load[@]}" "$OUT/ckpt/$policy")
    run_resumed "$group-${policy}_saves" "$world" "$ep"
    run_one "$group-${policy}_loads" "$world" "$ep" ${gargs[@]+"${gargs[@]}"} "${pargs[@]}" \
      "${load[@]}" "$OUT/ckpt/stock"
  done
}
GROUP_RE='^ep[0-9]+(pp[0-9]+)?(dist)?(rails)?(ckpt)?$'
for group in $RUN_GROUPS; do
  ep=$(group_size "$group" ep); pp=$(group_size "$group" pp)
  if ! [[ $group =~ $GROUP_RE ]] || [ "$ep" -lt 1 ] || [ "$pp" -lt 1 ]; then
    log "group $group: not ep<N>[pp<M>][dist][rails][ckpt] (e.g. ep2, ep2dist, ep4rails, ep2pp2, ep2ckpt): skipped"
    continue
  fi
  world=$((ep * pp))
  # an interleaved pipeline schedule needs its microbatches in multiples of the stages
  accum=$(( (ACCUM + pp - 1) / pp * pp ))
  set_group_args "$group"
  stock=()
  # megatron-core's alltoall dispatcher keeps its split sizes as CPU tensors, which all_to_all_single
  # refuses (scripts/megatron_lm_cpu.py): stock runs with several CPU ranks use the allgather one
  [ "$DEVICE" = cpu ] && [ "$world" -gt 1 ] && stock=(--moe-token-dispatcher-type allgather)
  if [[ $group == *ckpt* ]]; then
    check_checkpoints "$group" "$world" "$ep"
    continue
  fi
  if run_one "$group-stock" "$world" "$ep" ${gargs[@]+"${gargs[@]}"} ${stock[@]+"${stock[@]}"} \
      || { [ "$world" = 1 ] && [ "$DEVICE" = cuda ]; } || [ "${GLOO_RUN_ALL:-0}" = 1 ]; then
    for policy in $(group_policies "$group"); do
      set_policy_args "$group" "$policy"
      run_one "$group-$policy" "$world" "$ep" ${gargs[@]+"${gargs[@]}"} "${pargs[@]}"
    done
  else
    mark_skipped "$group"
  fi
done
[ "$PRINT_ONLY" = 1 ] && exit 0

log "loss table"
strict=(); [ "$DEVICE" = cpu ] && strict=(--strict)
PYTHONPATH="$REPO" "$PY" "$REPO/scripts/pretrain_loss_table.py" "$OUT" ${strict[@]+"${strict[@]}"} 2>&1 | tee -a "$OUT/script.log"
status=${PIPESTATUS[0]}
if ls "$OUT"/traces/*.npz > /dev/null 2>&1; then
  # every trace the default's runs recorded: a row per microbatch of each iteration it trained (a
  # checkpoint group's file: the resumed run's half), every rank's counts MICRO x seq x top-k
  log "routing traces (--rails-trace)"
  PYTHONPATH="$REPO" "$PY" "$REPO/scripts/pretrain_trace_check.py" "$OUT/traces" --iters "$ITERS" \
    --accum "$ACCUM" --pairs-per-rank $((MICRO * SEQ * 2)) 2>&1 | tee -a "$OUT/script.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
log "done (exit $status)"
exit "$status"
