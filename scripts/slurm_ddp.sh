#!/usr/bin/env bash
# Multi-node DDP with Slurm: one torchrun per node, each starting one process per GPU.
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_ddp.sh configs/gigaword.yaml train.max_steps=100000
#SBATCH --job-name=summarizer
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%j.out
set -euo pipefail
CONFIG=${1:-configs/gigaword.yaml}
shift || true
# The first node of the allocation hosts the rendezvous; every node's torchrun meets there.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
gpus_per_node=${SLURM_GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
gpus_per_node=${gpus_per_node##*:}
# A SIGTERM from Slurm (time limit, preemption) reaches every rank: the run checkpoints and exits,
# and resubmitting the same command resumes it.
srun --kill-on-bad-exit=1 .venv/bin/torchrun \
  --nnodes="$SLURM_NNODES" --nproc_per_node="$gpus_per_node" \
  --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:29500" \
  -m summarizer train --config "$CONFIG" "$@"
