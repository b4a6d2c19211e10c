#!/usr/bin/env bash
# Everything this project runs on the GPU, in one call of the device tool:
#   the whole test suite with Triton compiled for real, then the benchmarks, results under $OUT (or runs/).
# Wheels the GPU image lacks (liger-kernel for the side-by-side rows) travel in .whl/ and install to /tmp/site.
# Usage: bash benchmarks/run_gpu_suite.sh [tests|properties|bench-kernel|bench-step|bench-multi|all]...
#   fp8-logits / fp8-step / fp8-long: FP8 logits (tests + bench_loss_floor), the step
#   table beside Liger and torchao at seq 4096, and at seq 16384 / 32768 (each one device call, < 10 minutes)
#   properties: the hypothesis suite's larger "gpu" profile (several vocabulary and top-k tiles, Triton compiled)
#   sampled: the sampled loss's tests with its Triton kernel compiled (failures with their reason), then
#   bench_sampled_kd's 189M-teacher tables and bench_fp8_teacher's fidelity on the BPE vocabulary (~4 minutes;
#   TRAIN_SECONDS, default 30, trains each teacher)
#   tta-1 / tta-2: the time-to-accuracy benchmark over two calls; rollout-store, decode-students: their benchmarks
#   probe-jsd-order: how the JSD kernel walks a row (benchmarks/loss/probe_jsd_order.py) and its tests compiled
set -uo pipefail
OUT=${OUT:-runs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
for what in "${@:-all}"; do
  case $what in
    tests|all)
      # one thread a worker (16 workers x torch's 16 threads starved the servers the tests start: timeouts), each
      # slow phase and failure written as it ends (KD_TEST_TIMES; a cut run still names them); KD_TEST_ORDER=<an
      # earlier run's times file> runs the slowest first (default: tests/gpu_durations.txt, a GPU run's)
      OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 KD_TEST_TIMES="$OUT/test_times.txt" \
        KD_TEST_ORDER="${KD_TEST_ORDER:-tests/gpu_durations.txt}" python3 -m pytest \
        -n "${WORKERS:-16}" --dist "${DIST:-worksteal}" -rfE --durations=30 -p no:cacheprovider --timeout 240 tests 2>&1 | tee "$OUT/tests_gpu.log" | tail -25
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;&
    tests-core)
      python3 -m pytest -q -p no:cacheprovider tests/test_fused_linear_jsd.py tests/test_topk.py tests/test_kernels.py \
        tests/test_vocab_size.py tests/test_loss_edge_cases.py tests/test_reference.py tests/test_compile.py \
        tests/test_model_paths.py tests/test_patches.py tests/test_trainer.py tests/test_distributed.py \
        2>&1 | tee "$OUT/tests_core_gpu.log" | tail -25
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    demo|all)
      python3 -m liger_patch_kd.cli demo 2>&1 | tee "$OUT/demo_gpu.log" | tail -12 ;;&
    bench-multi|all)
      # several teachers: the mixture loss with 1, 2, 4 teachers (N 4096-16384: memory flat in N), and its tests
      python3 -m pytest -q -p no:cacheprovider tests/test_multi_teacher_loss.py tests/test_multi_teacher_trainer.py \
        2>&1 | tee "$OUT/tests_multi_teacher_gpu.log" | tail -5
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      python3 -m benchmarks.training.bench_multi_teacher --ns 4096 8192 16384 --out "$OUT/bench_multi_teacher.json" 2>&1 \
        | tee "$OUT/bench_multi_teacher.log" | grep -v "^{" ;;&
    probe-jsd-order)
      # the JSD kernel's walk order, hints, tile and warps, alone and in the whole loss beside the floor (~2 minutes),
      # then its float64 tests compiled
      python3 -m benchmarks.loss.probe_jsd_order --out "$OUT/probe_jsd_order.json" 2>&1 | tee "$OUT/probe_jsd_order.log" \
        | grep -v "^{"
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k jsd 2>&1 | tee "$OUT/tests_jsd_launch.log" | tail -3
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench-padded)
      python3 -m benchmarks.loss.bench_fused_linear_jsd --only padded --out "$OUT/bench_padded_vocab.json" 2>&1 \
        | tee "$OUT/bench_padded.log" | grep -v "^{" ;;
    bench-served|all)
      python3 -m benchmarks.teachers.bench_served_teacher --out "$OUT/bench_served_teacher.json" 2>&1 \
        | tee "$OUT/bench_served.log" | grep -v "^{" ;;&
    properties|all)
      # importorskip would turn a missing hypothesis into a silent skip: here it is a failure
      if python3 -c "import hypothesis" 2>/dev/null; then
        HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -p no:cacheprovider tests/test_properties.py 2>&1 \
          | tee "$OUT/properties_gpu.log" | tail -25
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      else
        echo "properties: hypothesis is not installed; put its wheel (and sortedcontainers') in .whl/" | tee "$OUT/properties_gpu.log"
        status=1
      fi ;;&
    fp8-logits)  # FP8 logits: their GPU tests, then the loss against its floor
      python3 -m pytest -q -p no:cacheprovider -rs tests/test_fp8_logits.py 2>&1 \
        | tee "$OUT/tests_fp8_logits_gpu.log" | tail -8
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      python3 -m benchmarks.loss.bench_loss_floor --out "$OUT/bench_loss_floor.json" 2>&1 | tee "$OUT/bench_loss_floor.log" \
        | grep -v "^{" ;;
    fp8-step|fp8-long)  # the fair step table at seq 4096 (mb 4), or the long-context rows (mb 1)
      shape_args=(--micro-batches 4 --seq 4096)
      [ "$what" = fp8-long ] && shape_args=(--micro-batches 1 --seq 16384 32768)
      python3 -m benchmarks.training.bench_train_step --shapes llama "${shape_args[@]}" --warmup 2 --reps 4 --methods \
        "liger_patch_kd" "liger_patch_kd fp8 teacher" "liger_patch_kd fp8 teacher, fp8 logits" "trl/liger+kernels both" \
        "trl/liger+kernels both, torchao fp8 teacher" --out "$OUT/bench_train_step_$what.json" 2>&1 \
        | tee "$OUT/bench_step_$what.log" | grep -v "^{" ;;
    sampled)
      # the top-k kernel's tests too: it shares the sampled kernel's row helpers (ops/triton_utils.py)
      python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_sampled_teacher.py \
        tests/test_sampled_kernel.py tests/test_topk.py tests/test_vocab_size.py tests/test_layout.py 2>&1 \
        | tee "$OUT/sampled_gpu_tests.log" | tail -60
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      python3 -m benchmarks.loss.bench_sampled_kd --teacher fp8bench --train-seconds "${TRAIN_SECONDS:-30}" --speed \
        --out "$OUT/bench_sampled_kd_bpe.json" 2>&1 | tee "$OUT/bench_sampled_kd_bpe.log" | grep -v "^teacher step\|Warning\|^  warn"
      python3 -m benchmarks.teachers.bench_fp8_teacher --tokenizer bpe --parts fidelity --train-seconds "${TRAIN_SECONDS:-30}" \
        --out "$OUT/bench_fp8_teacher_bpe.json" 2>&1 | tee "$OUT/bench_fp8_teacher_bpe.log" | grep -v "^teacher step\|Warning\|^  warn\|^{" ;;
    bench-kernel|all)
      python3 -m benchmarks.loss.bench_fused_linear_jsd --out "$OUT/bench_fused_linear_jsd.json" 2>&1 | tee "$OUT/bench_kernel.log" | grep -v "^{" ;;&
    bench-step|all)
      python3 -m benchmarks.training.bench_train_step --out "$OUT/bench_train_step.json" ${STEP_ARGS:-} 2>&1 | tee "$OUT/bench_step.log" | grep -v "^{" ;;
    tta-1|tta-2)
      # time to accuracy over two device calls (docs/benchmarks.md): tta-1 trains the teacher and each seed's
      # format-tuned student into $OUT/teacher and runs SFT on the ground truth and the on-policy rows beside TRL's
      # (TTA_RECIPES: other recipe names); tta-2 (carry the first call's files back: TTA_DIR=<them>) resumes with
      # every other recipe from the very same teacher and students. A call hands back at most 8 files of 16 MiB,
      # so tta-1 packs the teacher folder into parts of 15 MiB (teacher.tar.part-*) that tta-2 unpacks. Each is
      # cut at 560 s; the JSON keeps what it reached.
      dir=${TTA_DIR:-$OUT}
      if [ ! -d "$dir/teacher" ] && compgen -G "$dir/teacher.tar.part-*" >/dev/null; then
        cat "$dir"/teacher.tar.part-* | tar -x -C "$dir"
      fi
      opts=(--student-shape 96 2 --format-steps 1000 --steps 500 --checkpoints 20 --cap-seconds 15
            --trl-cap-seconds 15 --teacher-steps 1500 --store-steps 100 --store-top-k 8 --teacher-dir "$dir/teacher"
            --out "$dir/tta.json")
      read -ra extra <<< "${TTA_EXTRA:-}"  # more options, e.g. TTA_EXTRA="--labelled 2000 --cap-seconds 22"
      opts+=("${extra[@]}")
      if [ "$what" = tta-1 ]; then
        if [ -n "${TTA_RECIPES:-}" ]; then
          eval "recipes=(${TTA_RECIPES})"  # quoted names, as on a command line
        else
          recipes=("SFT on ground" "off-policy KD, JSD" "on-policy GKD (" "TRL GKD" "TRL Dist")
        fi
        opts+=(--recipes "${recipes[@]}")
      else
        opts+=(--resume)
      fi
      timeout 560 python3 -m benchmarks.accuracy.bench_time_to_accuracy "${opts[@]}" 2>&1 | tee "$OUT/$what.log" \
        | grep -v "^wrote\|^    step"
      [ "$dir" = "$OUT" ] || cp -r "$dir/tta.json" "$OUT/"
      if [ "$what" = tta-1 ] && [ -d "$OUT/teacher" ]; then
        tar -c -C "$OUT" teacher | split -b 15M - "$OUT/teacher.tar.part-" && rm -rf "$OUT/teacher"
      fi ;;
    rollout-store)  # a store's build by phase against the live step's generation rate, through generate() and the engine
      python3 -m benchmarks.teachers.bench_rollout_store --prompts 102400 --prompts-per-call 1024 \
        --out "$OUT/bench_rollout_store.json" 2>&1 | tee "$OUT/bench_rollout_store.log" | grep -v "^{"
      python3 -m benchmarks.teachers.bench_rollout_store --prompts 102400 --prompts-per-call 256 --cache graph \
        --out "$OUT/bench_rollout_store_graph.json" 2>&1 | tee -a "$OUT/bench_rollout_store.log" | grep -v "^{" ;;
    decode-students)  # a patched against an unpatched student's decode (the engine's kernels on and off)
      python3 -m benchmarks.onpolicy.bench_decode_students --out "$OUT/bench_decode_students.json" 2>&1 \
        | tee "$OUT/bench_decode_students.log" | grep -v "^{" ;;
  esac
done
exit $status
