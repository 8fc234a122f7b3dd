#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on CPU ranks over gloo, stock against every policy
# (scripts/pretrain_check.sh, DEVICE=cpu; CUDA placements answered by the CPU: scripts/megatron_lm_cpu.py),
# 4 microbatches per iteration, in groups each with its own stock run: 2 ranks (ep2-*); 2 ranks with the
# distributed optimizer and overlapped gradient reduce and parameter gather (ep2dist-*); 4 ranks over RailS
# on 2 virtual nodes (ep4rails-*); 2 interleaved pipeline stages of 2 ranks (ep2pp2-*); torch_dist
# checkpoints saved by each policy and resumed by stock, and the reverse (ep2ckpt-*).
#
#   bash scripts/cpu_pretrain_check.sh MEGATRON_LM_DIR [OUTDIR]
#
# Knobs: scripts/pretrain_check.sh's header. Exit status 1 when a run fails or its lm loss leaves its
# stock run's (scripts/pretrain_loss_table.py --strict).
DEVICE=cpu CHECK_NAME=cpu_pretrain_check exec bash "$(dirname "$0")/pretrain_check.sh" "$@"
