#!/usr/bin/env bash
# The 2-GPU runs, one device call per line below, results under $OUT (or runs/):
#   bash benchmarks/run_gpu_x2.sh scaling fsdp1 zero3    # FSDP2 1 vs 2 GPUs, FSDP1, ZeRO-3 (1B student, 8B teacher)
#   bash benchmarks/run_gpu_x2.sh 70b parity             # 70B teacher over 2 GPUs; the 2-GPU parity tests
#   bash benchmarks/run_gpu_x2.sh xtok                   # across tokenizers under FSDP2: NCCL parity
#                                                        # tests, then KDTrainer on 2 GPUs against 1
# Modes: scaling | fsdp1 | zero3 | 70b | parity | xtok | tiny (all of it on CPU with tiny shapes, gloo; a smoke test;
# `tiny xtok`: one mode so).
# Each run writes its JSON as soon as it ends (multi_<label>.json), then multi_summary.json is rebuilt, so a run
# cut short loses only itself. The whole call keeps to BUDGET_S seconds (default 510): every run gets what is
# left (minus a margin) as its timeout, and a run that cannot get 40 s is skipped and said so.
# Every run: bf16 mixed precision, sequence 4096 (SEQ), WARMUP + STEPS steps (3 + 10; 70B: 2 + 4).
set -uo pipefail
OUT=${OUT:-runs}
mkdir -p "$OUT"
LOG="$OUT/run_gpu_x2.log"
# NVLink multicast stays off (the device README: it can put the host's GPUs out of service)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
END=$((SECONDS + ${BUDGET_S:-510}))
SEQ=${SEQ:-4096} WARMUP=${WARMUP:-3} STEPS=${STEPS:-10}
MP=() TINY=()
if [[ " $* " == *" tiny "* ]]; then
  MP=(--mixed_precision no) TINY=(--tiny) WARMUP=1 STEPS=3
  modes=()
  for m in "$@"; do [ "$m" = tiny ] || modes+=("$m"); done
  [ ${#modes[@]} = 0 ] && modes=(scaling fsdp1 zero3 70b xtok)  # `tiny xtok`: that mode only
  set -- "${modes[@]}"
  echo "tiny: CPU processes over gloo, tiny shapes (FSDP1 needs a GPU: accelerate refuses it on CPU)" | tee -a "$LOG"
elif compgen -G ".whl/*.whl" >/dev/null; then  # deepspeed (and its pure-Python needs) travel as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ ${#TINY[@]} = 0 ]; then
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m; } 2>&1 | tee -a "$LOG"
  python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(),
    'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tee -a "$LOG"
fi
status=0 port=29510

# run LABEL NPROC CONFIG [bench args...]: one accelerate launch of the benchmark, bounded by what is left
run() {
  local label=$1 nproc=$2 config=$3 left=$((END - SECONDS - 15))
  shift 3
  if [ $left -lt 40 ]; then
    echo "SKIPPED $label: ${left}s left of BUDGET_S" | tee -a "$LOG"; status=1; return
  fi
  port=$((port + 1))
  local cmd=(accelerate launch --config_file "$config" --num_processes "$nproc" --main_process_port "$port" "${MP[@]}"
             -m benchmarks.training.bench_multi_gpu --seq "$SEQ" --warmup "$WARMUP" --steps "$STEPS" "${TINY[@]}"
             --label "$label" --out "$OUT/multi_$label.json" "$@")
  echo "=== $label (timeout ${left}s): ${cmd[*]}" | tee -a "$LOG"
  local start
  start=$(wc -l <"$LOG")
  BENCH_LAUNCHER="${cmd[*]}" timeout -k 10 "$left" "${cmd[@]}" >>"$LOG" 2>&1
  local rc=$?
  tail -n +$((start + 1)) "$LOG" | grep -E "^$label: |Error|error:" | tail -4
  [ $rc = 0 ] || { echo "FAILED $label: exit $rc (124: timed out), see $LOG" | tee -a "$LOG"; status=1; }
  python3 -m benchmarks.training.bench_multi_gpu --summarize "$OUT/multi_*.json" --out "$OUT/multi_summary.json" >/dev/null 2>&1
}

for mode in "$@"; do
  case $mode in
    scaling)  # the same global batch of 8 sequences: micro-batch 8 on one GPU, 4 on each of two
      run fsdp2_1gpu 1 examples/accelerate_fsdp2.yaml --micro-batches 8
      run fsdp2_2gpu 2 examples/accelerate_fsdp2.yaml --micro-batches 4 ;;
    fsdp1)
      if [ ${#TINY[@]} = 0 ]; then run fsdp1_2gpu 2 examples/accelerate_fsdp1.yaml --micro-batches 4; fi ;;
    zero3)
      if python3 -c "import deepspeed" >/dev/null 2>&1; then
        run zero3_2gpu 2 examples/accelerate_zero3.yaml --micro-batches 4
      else
        echo "SKIPPED zero3_2gpu: deepspeed does not import (carry its wheel in .whl/)" | tee -a "$LOG"; status=1
      fi ;;
    70b)  # teacher built sharded (meta device, to_empty, init per shard); micro-batch 1 and 2: the loss stays flat
      W=$WARMUP S=$STEPS
      [ ${#TINY[@]} = 0 ] && W=2 S=4
      WARMUP=$W STEPS=$S run 70b_2gpu 2 examples/accelerate_fsdp2.yaml --teacher 70b --meta-init --micro-batches 1 2 ;;
    parity)  # 2 GPUs against 1 process on the whole batch: FSDP2 and FSDP1, float64 and bf16
      left=$((END - SECONDS - 10))
      echo "=== parity (timeout ${left}s): pytest tests/test_distributed.py" | tee -a "$LOG"
      timeout -k 10 "$left" python3 -m pytest -q -p no:cacheprovider -rA tests/test_distributed.py 2>&1 \
        | tee "$OUT/parity_tests.log" | tail -15
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    xtok)  # across tokenizers: the NCCL parity tests (GPUs only), then KDTrainer under FSDP2, 2 processes against 1
      left=$((END - SECONDS - 10))
      if [ ${#TINY[@]} = 0 ]; then
        echo "=== xtok parity (timeout ${left}s): pytest tests/test_distributed.py -k cross_tokenizer" | tee -a "$LOG"
        timeout -k 10 "$left" python3 -m pytest -q -p no:cacheprovider -rA tests/test_distributed.py -k cross_tokenizer \
          2>&1 | tee "$OUT/xtok_parity_tests.log" | tail -6
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      fi
      XTOK=(-m benchmarks.training.bench_multi_gpu_xtok --steps "$STEPS")
      [ ${#TINY[@]} = 0 ] && XTOK+=(--hidden 1024 --layers 8 --bf16)
      port=$((port + 1)) left=$((END - SECONDS - 15))
      echo "=== xtok 1 process, micro-batch 8 / 2 processes (FSDP2), micro-batch 4 (timeout ${left}s each)" | tee -a "$LOG"
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$left" python3 "${XTOK[@]}" --micro-batch 8 --out "$OUT/xtok_1.json" \
        >>"$LOG" 2>&1 || { echo "FAILED xtok_1" | tee -a "$LOG"; status=1; }
      left=$((END - SECONDS - 15))
      timeout -k 10 "$left" accelerate launch --config_file examples/accelerate_fsdp2.yaml --num_processes 2 \
        --main_process_port "$port" "${MP[@]}" "${XTOK[@]}" --micro-batch 4 --out "$OUT/xtok_fsdp2.json" >>"$LOG" 2>&1 \
        || { echo "FAILED xtok_fsdp2" | tee -a "$LOG"; status=1; }
      python3 -m benchmarks.training.bench_multi_gpu_xtok --compare "$OUT/xtok_1.json" "$OUT/xtok_fsdp2.json" \
        --out "$OUT/xtok_summary.json" 2>&1 | tee -a "$LOG" | tail -4 || status=1 ;;
    *) echo "unknown mode $mode (scaling | fsdp1 | zero3 | 70b | parity | xtok | tiny)"; exit 2 ;;
  esac
done
[ -f "$OUT/multi_summary.json" ] && python3 -c "import json; print(json.load(open('$OUT/multi_summary.json'))['table'])"
exit $status
