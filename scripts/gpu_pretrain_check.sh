#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on one GPU, stock against every policy (scripts/pretrain_check.sh,
# DEVICE=cuda): one rank with NCCL (ep1-*), then two ranks sharing the GPU over gloo (ep2-*).
#
#   bash scripts/gpu_pretrain_check.sh MEGATRON_LM_DIR [OUTDIR]
#
# Knobs: scripts/pretrain_check.sh's header.
DEVICE=cuda CHECK_NAME=gpu_pretrain_check exec bash "$(dirname "$0")/pretrain_check.sh" "$@"
