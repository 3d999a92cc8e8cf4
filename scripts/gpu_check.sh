#!/usr/bin/env bash
# The GPU's check: training speed and loss per precision from a cold start, the bench's GPU rows, decoding per
# precision and beam, model-parallel placement and DDP, configs/gigaword.yaml's model on synthetic pairs, and
# profiles of training's first steps, of a decode and of gigaword.yaml's steps (captured and launched from Python).
# Ends with one Markdown table (also GPU_CHECK_OUT/gpu_check.md). At most 8 minutes on one H100 (GPU_CHECK_SECONDS):
# the parts run in the order of what they decide (1, 3, 5, 2, 6, 4), and those the budget no longer reaches are listed
# as skipped.
#   bash scripts/gpu_check.sh DATA_DIR         # DATA_DIR: prepared with configs/base.yaml
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_STEPS=20 bash scripts/gpu_check.sh DATA_DIR   # the same steps on a CPU, tiny
#   (each step there may take 3x its GPU cap; GPU_CHECK_SECONDS bounds the whole)
# Every part does not fit 8 minutes on one GPU: on an H100 parts 1, 3 and 6 take 7.5. The rest in a second call
# (part 5: about 2.5 minutes eager, and each compiled run its compilation besides; part 2 gets what is left):
#   GPU_CHECK_PARTS="5 2" GPU_CHECK_SECONDS=480 GPU_CHECK_OUT=gpu_check_out2 bash scripts/gpu_check.sh DATA_DIR
# Environment: PYTHON, GPU_CHECK_OUT (default gpu_check_out, must not hold an earlier check), GPU_CHECK_STEPS (300),
# GPU_CHECK_LOG_EVERY (part 1's log interval: a sixth of the steps, at most 50),
# GPU_CHECK_CONFIG (configs/base.yaml; configs/tiny.yaml on a CPU), GPU_CHECK_SECONDS (450: parts are
# skipped once it is spent), GPU_CHECK_PARTS ("1 2 3 4 5 6": the parts to run; 3 and 6 decode part 1's fp32 run),
# GPU_CHECK_PRECISIONS ("fp32 bf16 fp16 auto auto_captured": part 1's runs; <precision>_captured: with
# train.cuda_graphs=true, the others with false; auto_captured is the default config),
# GPU_CHECK_GW_RUNS ("bf16 fp32 bf16_compile bf16_graphs bf16_captured bf16_compile_captured": part 5's runs; also
# fp32_compile, fp32_graphs, fp32_captured, and any of them with _b<tokens>, another data.batch_tokens),
# GPU_CHECK_GW_MINUTES (0.6 per eager run), GPU_CHECK_GW_STEPS (600 per compiled run), GPU_CHECK_GW_PAIRS (100000),
# GPU_CHECK_GW_DATA (part 5's synthetic pairs already prepared with configs/gigaword.yaml, for a machine without the
# `datasets` package data_prep needs), GPU_CHECK_BENCH_ROWS (part 2's bench rows, in order, e.g. "naive_vs_default,
# cuda_graphs"; default: the list at part 2), GPU_CHECK_COMMIT (the commit the report names, for a copy of the tree
# without its .git; default: git describe).
set -uo pipefail
[ $# -eq 1 ] && [ -f "$1/meta.json" ] || { echo "usage: bash scripts/gpu_check.sh DATA_DIR (a prepared data dir:" \
  "python -m data_prep --config configs/base.yaml data.source=DIR data.dir=DATA_DIR)" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DATA=$(realpath "$1")
OUT=$(realpath -m "${GPU_CHECK_OUT:-gpu_check_out}")  # not $OUT: a job's own output dir often goes by that name
cd "$ROOT" || exit 2
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # nothing here needs the hub; a machine without network never waits on it
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())') ||
  { echo "gpu_check: $PY cannot import torch" >&2; exit 2; }
if [ "${GPU_CHECK_DEVICE:-cuda}" = cpu ]; then
  DEV=cpu; STEPS=${GPU_CHECK_STEPS:-20}; CONFIG=${GPU_CHECK_CONFIG:-configs/tiny.yaml}
  BUDGET=${GPU_CHECK_SECONDS:-900} CAP=3  # a step's cap is a GPU's: a CPU shared with other work may need 3x
elif [ "$GPUS" -ge 1 ]; then
  DEV=cuda; STEPS=${GPU_CHECK_STEPS:-300}; CONFIG=${GPU_CHECK_CONFIG:-configs/base.yaml}
  BUDGET=${GPU_CHECK_SECONDS:-450} CAP=1
else
  echo "gpu_check: no GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); to run the same" \
    "steps on the CPU with tiny budgets: GPU_CHECK_DEVICE=cpu GPU_CHECK_STEPS=20 bash scripts/gpu_check.sh $1" >&2
  exit 1
fi
if [ -e "$OUT/notes.txt" ]; then echo "gpu_check: $OUT holds an earlier check: remove it or set GPU_CHECK_OUT" >&2; exit 2; fi
mkdir -p "$OUT/logs" && : > "$OUT/notes.txt" || exit 2
LOG=$((STEPS / 6 > 50 ? 50 : STEPS / 6)); LOG=${GPU_CHECK_LOG_EVERY:-$((LOG > 0 ? LOG : 1))}
FEW=$((STEPS / 10 > 30 ? 30 : STEPS / 10)); FEW=$((FEW > 2 ? FEW : 2))
DEADLINE=$((SECONDS + BUDGET))
PARTS=${GPU_CHECK_PARTS:-1 2 3 4 5 6}
FAILED=0
COMMON=(--config "$CONFIG" "data.dir=$DATA" "run.tensorboard_dir=$OUT/tb" "system.device=$DEV")
# N steps, a log every L; validation (loss only: best.pt by loss) and the checkpoint once, at the end, so they
# never land inside a throughput window.
schedule() { echo "train.max_steps=$1" "train.log_every=$2" "train.eval_every=$1" "train.ckpt_every=$1" \
  train.rouge_every=0 train.select_by=loss; }

skip() { echo "gpu_check: part $1, $2: skipped: $3"; echo "$1|$2|skipped: $3" >> "$OUT/notes.txt"; }

step() {  # step PART LABEL SECONDS COMMAND...: run it under a timeout cut to what is left of the budget
  local part=$1 label=$2 limit=$(($3 * CAP)) left=$((DEADLINE - SECONDS)) rc log="$OUT/logs/$1-${2// /_}.log" cut=0
  shift 3
  if [[ " $PARTS " != *" $part "* ]]; then skip "$part" "$label" "not among GPU_CHECK_PARTS ($PARTS)"; return 1; fi
  if [ "$left" -lt 30 ]; then skip "$part" "$label" "the time budget (GPU_CHECK_SECONDS=$BUDGET) is spent"; return 1; fi
  if [ "$left" -lt "$limit" ]; then limit=$left; cut=1; fi
  echo "gpu_check: part $part, $label (at most ${limit}s) ..."
  timeout -k 15 "$limit" "$@" > "$log" 2>&1
  rc=$?
  if [ "$cut" -eq 1 ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then  # the budget ran out: not a fault
    echo "gpu_check: part $part, $label: cut short after ${limit}s by the time budget"
    echo "$part|$label|cut short after ${limit}s, when the time budget (GPU_CHECK_SECONDS=$BUDGET) ran out: what it wrote is reported; log $log" >> "$OUT/notes.txt"
    return "$rc"
  fi
  if [ "$rc" -ne 0 ]; then
    FAILED=1
    echo "$part|$label|failed: exit $rc$([ "$rc" -eq 124 ] && echo " (timed out after ${limit}s)"); log $log" \
      >> "$OUT/notes.txt"
    echo "gpu_check: part $part, $label failed (exit $rc); last lines of $log:"; tail -n 5 "$log"
  fi
  return "$rc"
}

TRAIN=("$PY" -m summarizer train "${COMMON[@]}")

# 1. The recipe from a cold start in each precision, each in its own process, its steps launched from Python; auto:
# what it chose (by a probe timing fp32 against bf16 on the run's first batches) and whether it trains as fast as
# the faster of the two; <precision>_captured: each batch shape's whole step captured as a CUDA graph and replayed
# (train.cuda_graphs); auto_captured: the default config (16 bit by rule).
for p in ${GPU_CHECK_PRECISIONS:-fp32 bf16 fp16 auto auto_captured}; do
  step 1 "train $p" 120 "${TRAIN[@]}" "run.name=gc_$p" "run.dir=$OUT/train/$p" "train.precision=${p%_captured}" \
    "train.cuda_graphs=$([ "$p" != "${p%_captured}" ] && echo true || echo false)" $(schedule "$STEPS" "$LOG")
done

# 3. The fp32 run's best.pt decoded on the test split at beam 4 and greedy: the dynamic fp32 search (the reference),
# the default (auto; on a GPU static shapes for greedy, the reference's settings for beam 4, there showing run-to-run
# noise), static shapes (a CUDA graph of each whole step), at beam 4 bf16, and batches a quarter of the default's
# (on a GPU the default takes the whole split in one batch: a step's cost is its launches, so fewer, fuller steps).
# The report compares each one's predictions and speed with the reference's. Each of a set precision decodes without
# int8 layers, as on a GPU (eval.quantize auto is int8 on a CPU in fp32; they scale activations per batch, so batches
# of other shapes would decode other words, which is not what these comparisons are about); the default (auto) is
# left as it is: on a CPU, int8 in fp32 whether or not the CPU has fast bf16.
LIMIT=$([ "$DEV" = cuda ] && echo 0 || echo 40)
if [ -f "$OUT/train/fp32/best.pt" ]; then
  QUARTER=$([ "$DEV" = cuda ] && echo 524288 || echo 4096)
  for e in beam4:4:fp32:dynamic: beam4:4:auto:auto: beam4:4:fp32:static: beam4:4:bf16:dynamic: \
      "beam4:4:fp32:dynamic:$QUARTER" greedy:1:fp32:dynamic: greedy:1:auto:auto: greedy:1:fp32:static: \
      "greedy:1:fp32:dynamic:$QUARTER"; do
    IFS=: read -r name beam p shapes batch <<< "$e"
    run=${name}_${p}_$shapes${batch:+_$batch}
    step 3 "eval $run" 90 "$PY" -m summarizer eval "${COMMON[@]}" run.name=gc_fp32 "run.dir=$OUT/train/fp32" \
      "eval.out_dir=$OUT/eval/$run" "eval.beam_size=$beam" "eval.precision=$p" "eval.shapes=$shapes" \
      "eval.batch_tokens=${batch:-0}" "eval.limit=$LIMIT" eval.bootstrap_samples=200 \
      "eval.quantize=$([ "$p" = auto ] && echo auto || echo none)"
  done
else
  skip 3 eval "no checkpoint: part 1's fp32 run did not finish (failed, or not run)"
fi

# 5. gigaword.yaml's model (60M parameters, 16k-token batches, 32k vocabulary) on synthetic pairs (GPU_CHECK_GW_RUNS):
# bf16 and fp32 eager, bf16 compiled (<precision>_compile), compiled with CUDA graphs (<precision>_graphs:
# train.compile_mode=reduce-overhead), and eager with each batch shape's whole step captured as a CUDA graph
# (<precision>_captured: train.cuda_graphs=true), the last two together (<precision>_compile_captured: compiled
# layers inside the captured step); a suffix _b<tokens> sets data.batch_tokens (bf16_b65536: what a larger batch does
# to MFU). An eager or captured run trains for GPU_CHECK_GW_MINUTES (up to 200 s in all); a compiled
# one for GPU_CHECK_GW_STEPS steps whatever its compilation takes (up to 300 s in all; its log says how long the first
# step compiled and what recompiled). The report's figures are the last third of each run's steps.
SYN=${GPU_CHECK_GW_DATA:-$OUT/synthetic/data}
GW=("$PY" -m summarizer train --config configs/gigaword.yaml "data.dir=$SYN" "run.tensorboard_dir=$OUT/tb"
    train.sample_summaries=0)  # no text samples: synthetic pairs have no words to read
if [ "$DEV" = cuda ]; then
  { [ -n "${GPU_CHECK_GW_DATA:-}" ] ||
    { step 5 "synthetic pairs" 60 "$PY" scripts/gpu_check_report.py synth "$DATA" "$OUT/synthetic/pairs" \
        --pairs "${GPU_CHECK_GW_PAIRS:-100000}" &&
      step 5 "prep 32k vocabulary" 150 "$PY" -m data_prep --config configs/gigaword.yaml \
        "data.source=$OUT/synthetic/pairs" "data.dir=$SYN"; }; } &&
    for v in ${GPU_CHECK_GW_RUNS:-bf16 fp32 bf16_compile bf16_graphs bf16_captured bf16_compile_captured}; do
      steps=${GPU_CHECK_GW_STEPS:-600} minutes=0 limit=300 captured=false
      case ${v%_b[0-9]*} in *_captured) captured=true ;; esac
      case ${v%_b[0-9]*} in *_compile|*_compile_captured) compiled=true mode=default ;;
        *_graphs) compiled=true mode=reduce-overhead ;;
        *) compiled=false mode=default steps=100000 minutes=${GPU_CHECK_GW_MINUTES:-0.6} limit=200 ;; esac
      case $v in *_b[0-9]*) batch=(data.batch_tokens="${v##*_b}") ;; *) batch=() ;; esac
      step 5 "gigaword $v" "$limit" "${GW[@]}" "run.name=gc_gigaword_$v" "run.dir=$OUT/gigaword/$v" "train.precision=${v%%_*}" \
        "train.compile=$compiled" "train.compile_mode=$mode" "train.cuda_graphs=$captured" \
        "train.max_minutes=$minutes" "${batch[@]}" \
        $(schedule "$steps" 50)
    done
else
  skip 5 gigaword.yaml "a 60M-parameter model: GPU only"
fi

# 2. The bench's training rows (NOT_HERE rows such as pin_memory on a CPU are listed as skipped).
# The AMP rows twice: the first epoch's new batch shapes, and the second epoch's (shapes seen before). On a GPU one
# repeat a variant, of 40 steps (ten steps of the same settings ran 95k-172k tokens/s on an H100): each second-epoch
# run trains a whole epoch first, in a process of its own.
# The rows in the order of what they decide: should the budget cut the bench short, bench.json keeps those done.
ROWS="naive_vs_default, cuda_graphs, precision_bf16, precision_fp16, fused_optimizer, workers, pin_memory, "
ROWS+="cudnn_benchmark, attention_kernel, fused_loss, pad_multiple, pad_rows, precision_bf16_epoch2, precision_fp16_epoch2"
ROWS="[${GPU_CHECK_BENCH_ROWS:-$ROWS}]"
step 2 bench 270 "$PY" -m summarizer bench "${COMMON[@]}" run.name=gc_bench "run.dir=$OUT/bench" "bench.rows=$ROWS" \
  $([ "$DEV" = cuda ] && echo bench.repeats=1 bench.warmup=1 bench.steps=40 || echo bench.repeats=1 bench.warmup=0 bench.steps=2) \
  bench.find_batch_tokens=false

# 6. Where the time goes, by torch.profiler: the first steps of a fresh run (new batch shapes) in fp32 and bf16,
# launched from Python (profile.txt: operators by device time), a beam-4 and a greedy decode of the test split with
# the fp32 run's weights, and gigaword.yaml's model past its first epoch (below).
PROFILE_STEPS=$((FEW > 20 ? 20 : FEW))
for p in fp32 bf16; do
  step 6 "profile train $p" 90 "${TRAIN[@]}" "run.name=gc_profile_$p" "run.dir=$OUT/profile/train_$p" \
    "train.precision=$p" train.cuda_graphs=false "train.profile_steps=$PROFILE_STEPS" \
    $(schedule $((PROFILE_STEPS + 3)) $((PROFILE_STEPS + 3)))
done
if [ -f "$OUT/train/fp32/best.pt" ]; then
  for e in decode:4 decode_greedy:1; do
    step 6 "profile ${e%%:*}" 90 "$PY" -m summarizer bench "${COMMON[@]}" "run.name=gc_${e%%:*}_profile" \
      "run.dir=$OUT/profile/${e%%:*}" "bench.rows=[decode_profile]" "bench.checkpoint=$OUT/train/fp32/best.pt" \
      "bench.decode_sentences=$([ "$DEV" = cuda ] && echo 2000 || echo 40)" bench.find_batch_tokens=false \
      "eval.beam_size=${e##*:}"
  done
else
  skip 6 "profile decode" "no checkpoint: part 1's fp32 run did not finish (failed, or not run)"
fi
# gigaword.yaml's model in bf16 past the first epoch's new shapes (an epoch of the synthetic pairs is about 290
# steps): steps 302-311 of one process. A resumed process would meet every shape anew. Logged only at the end: a
# logged step also reads the per-module statistics. Captured (the default) first: its kernels as the graphs replay
# them, and how busy they keep the GPU (what bounds MFU once launches cost nothing); then launched from Python.
if [ "$DEV" = cuda ] && [ -f "$SYN/meta.json" ]; then
  for captured in true false; do
    name=gigaword_bf16$([ "$captured" = true ] && echo _captured)
    step 6 "profile ${name//_/ }" 120 "${GW[@]}" "run.name=gc_profile_$name" "run.dir=$OUT/profile/$name" \
      train.precision=bf16 "train.cuda_graphs=$captured" train.profile_steps=10 train.profile_after=300 \
      $(schedule 312 312)
  done
else
  skip 6 "profile gigaword bf16" "GPU only, with part 5's synthetic pairs"
fi

# 4. Encoder and decoder on two devices, a few steps each; DDP over NCCL on two GPUs.
placement() {  # placement NAME ENCODER DECODER
  step 4 "placement $1" 90 "${TRAIN[@]}" "run.name=gc_$1" "run.dir=$OUT/placement/$1" train.precision=fp32 \
    $(schedule $((FEW * 3)) "$FEW") "placement.encoder_device=$2" "placement.decoder_device=$3"
}
if [ "$DEV" = cuda ]; then placement enc-cuda0_dec-cpu cuda:0 cpu; else placement enc-cpu_dec-cpu cpu cpu; fi
if [ "$DEV" = cuda ] && [ "$GPUS" -ge 2 ]; then
  placement enc-cuda0_dec-cuda1 cuda:0 cuda:1
  DDP_STEPS=$((STEPS / 3))
  step 4 "ddp nccl_2gpus" 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m summarizer train \
    "${COMMON[@]}" run.name=gc_ddp "run.dir=$OUT/ddp/nccl_2gpus" train.precision=fp32 \
    $(schedule "$DDP_STEPS" "$((DDP_STEPS / 4))")
else
  skip 4 "cuda:0 + cuda:1, DDP" "needs two GPUs (this machine: $GPUS)"
fi

"$PY" scripts/gpu_check_report.py report "$OUT" --device "$DEV" || FAILED=1
echo "gpu_check: $((SECONDS / 60)) min $((SECONDS % 60)) s; table in $OUT/gpu_check.md; logs in $OUT/logs"
exit "$FAILED"
