#!/usr/bin/env bash
# Run Megatron-LM's own pretrain_gpt.py through the megatron-rails launcher (docs/megatron-lm.md,
# launcher route) on one GPU: a small MoE GPT (4 layers, hidden 512, 8 experts top-2, alltoall
# dispatcher, mock data, fp32), stock and with --moe-balancer none/eplb/fsep/ultraep/lp.
#
#   bash scripts/gpu_pretrain_check.sh MEGATRON_LM_DIR [OUTDIR]
#
#   a. one rank, NCCL:                          ep1-stock, ep1-none, ... ep1-lp
#   b. two ranks on the same GPU, gloo, EP=2:   ep2-stock, ep2-none, ... ep2-lp
#
# Each run's full log goes to OUTDIR/<name>.log (its command line to OUTDIR/<name>.cmd, its exit status
# to OUTDIR/<name>.rc); a failing run never stops the script (but a failed multi-rank stock run skips
# that world size's policy runs, which would have nothing to compare with, unless GLOO_RUN_ALL=1). Then scripts/pretrain_loss_table.py OUTDIR
# compares every run's per-iteration lm loss with the stock run of the same world size (OUTDIR/table.md).
#
# Environment knobs: EXTRA_ARGS (appended to every run's arguments), PYTHON (python3), ITERS (50), RUN_TIMEOUT (150 s per run), POLICIES, WORLDS ("1 2"),
# DETERMINISTIC (1: --deterministic-mode), PRINT_ONLY=1 (print each run's command line and exit: used by the
# CPU dry test), SITE (/tmp/gpu_check_site: where wheels carried in .whl/ are unpacked), PORT_BASE (29400),
# SETUP_ONLY=1 (unpack, build Megatron's dataset helpers, then exit: before instances run side by side),
# GLOO_RUN_ALL=1 (run a world size's policy runs even when its stock run failed).
set -u

usage() { echo "usage: bash scripts/gpu_pretrain_check.sh MEGATRON_LM_DIR [OUTDIR]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
[ -f "$1/pretrain_gpt.py" ] || { echo "gpu_pretrain_check: $1/pretrain_gpt.py not found" >&2; usage; }

REPO=$(cd "$(dirname "$0")/.." && pwd)
MLM=$(cd "$1" && pwd)
OUT=${2:-gpu_pretrain_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
ITERS=${ITERS:-50}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
POLICIES=${POLICIES:-"none eplb fsep ultraep lp"}
WORLDS=${WORLDS:-"1 2"}
DETERMINISTIC=${DETERMINISTIC:-1}
PRINT_ONLY=${PRINT_ONLY:-0}
SITE=${SITE:-/tmp/gpu_check_site}
MICRO=4

log() { echo "[gpu_pretrain_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/script.log"; }

# -- the model and training arguments (the same for every run) -------------------------------------------
COMMON=(
  --num-layers 4 --hidden-size 512 --ffn-hidden-size 1024 --num-attention-heads 8
  --seq-length 256 --max-position-embeddings 256
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
run_one() {  # NAME WORLD [EXTRA ARGS...]
  local name=$1 world=$2; shift 2
  local ep backend extra=()
  # --deterministic-mode (torch.use_deterministic_algorithms); RUN_DET=0 turns it off for one run
  [ "${RUN_DET:-$DETERMINISTIC}" = 1 ] && extra+=(--deterministic-mode)
  if [ "$world" = 1 ]; then
    ep=1; backend=nccl
  else
    # both ranks on cuda:0: Megatron-LM core_v0.16 does torch.cuda.set_device(args.local_rank), and
    # --local-rank defaults to $LOCAL_RANK (1 on the second rank): pass 0 explicitly. NCCL refuses two
    # ranks on one GPU, hence gloo.
    ep=$world; backend=gloo; extra+=(--local-rank 0)
  fi
  PORT=$((PORT + 1))
  local cmd=(timeout -k 15 "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node "$world"
             --master-addr 127.0.0.1 --master-port "$PORT"
             -m megatron_rails.launch "$MLM/pretrain_gpt.py" "${COMMON[@]}"
             --global-batch-size $((MICRO * world)) --distributed-backend "$backend"
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
    RUN_DET=0 run_one "$name" "$world" "$@"
    return $?
  fi
  return "$rc"
}

if [ "$PRINT_ONLY" != 1 ]; then
  : > "$OUT/script.log"
  log "repo $REPO, Megatron-LM $MLM, out $OUT, $ITERS iterations, timeout $RUN_TIMEOUT s per run"

  # -- Python path: megatron_rails from the repo, megatron.core/.training from the checkout --------------
  if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
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
  export PYTHONPATH="$REPO:$MLM${PYTHONPATH:+:$PYTHONPATH}:$SITE"
  export MEGATRON_LM_DIR="$MLM"
  export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_ALGO=Ring CUDA_DEVICE_MAX_CONNECTIONS=1
  export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TORCH_NCCL_ASYNC_ERROR_HANDLING=1

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
  # builds nothing else; without nvcc, a stand-in answers the version.
  if ! "$PY" -c 'import subprocess; from torch.utils import cpp_extension as c; subprocess.check_output([c.CUDA_HOME + "/bin/nvcc", "-V"])' \
      > /dev/null 2>&1; then
    mkdir -p "$SHIM/cuda/bin"
    printf '#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.0"\n' > "$SHIM/cuda/bin/nvcc"
    chmod +x "$SHIM/cuda/bin/nvcc"; export CUDA_HOME="$SHIM/cuda"
    log "no nvcc under torch's CUDA_HOME: a stand-in nvcc -V at $CUDA_HOME"
  fi
fi

[ "${SETUP_ONLY:-0}" = 1 ] && { log "setup done (SETUP_ONLY=1: no runs)"; exit 0; }

# -- the runs ------------------------------------------------------------------------------------------
for world in $WORLDS; do
  if run_one "ep$world-stock" "$world" || [ "$world" = 1 ] || [ "${GLOO_RUN_ALL:-0}" = 1 ]; then
    for policy in $POLICIES; do
      run_one "ep$world-$policy" "$world" --moe-balancer "$policy"
    done
  else
    log "ep$world-stock failed: the ep$world policy runs are skipped (GLOO_RUN_ALL=1 runs them anyway)"
    for policy in $POLICIES; do
      echo "skipped: ep$world-stock failed (see ep$world-stock.log)" > "$OUT/ep$world-$policy.log"
      echo skipped > "$OUT/ep$world-$policy.rc"
    done
  fi
done
[ "$PRINT_ONLY" = 1 ] && exit 0

log "loss table"
PYTHONPATH="$REPO" "$PY" "$REPO/scripts/pretrain_loss_table.py" "$OUT" 2>&1 | tee -a "$OUT/script.log"
status=${PIPESTATUS[0]}
log "done (table exit $status)"
exit "$status"
