#!/usr/bin/env bash
# What we run on the GPU machine, in stages. Each benchmark rewrites its own section of
# lab/results/<gpu>.md (lab/bench/results_page.py); the page, the summaries and one results.tgz (logs)
# come back under $OUT where the device tool sets it.
#
#   bash lab/gpu.sh fa4 tests       # carry .whl/fa4: flash-attn-4 installed, GPU tests
#   bash lab/gpu.sh encoder preprocess decode perf e2e soak
#
# Stages:
#   fa4         flash-attn-4 unpacked from .whl/fa4 (lab/pack_gpu_wheels.sh --fa4), once per machine
#   tests       tests/gpu and the Pillow-exactness tests on the GPU (GPU_TESTS names others)
#   encoder     the encoder against transformers, MFU and RoPE (lab/bench/encoder_bench.py)
#   preprocess  GPU preprocessing against the checkpoint processor (lab/bench/preprocess_bench.py)
#   decode      exact GPU JPEG decoding against Pillow (lab/bench/decode_bench.py)
#   perf        perf_analyzer, 1x1024^2 and 8x448^2 at concurrency 1 and 16, the encoder alone in the same
#               run (lab/bench/perf.py; PERF_ENSEMBLES=plain for one ensemble)
#   perf3000    the same for 1x3000^2 at concurrency 1 and 4
#   firsttime   where a size's first time goes, without tritonserver (lab/bench/first_time.py)
#   mixed       sizes never seen: the first request after start-up, 40 random sizes twice (lab/bench/mixed_sizes.py)
#   e2e         JPEG bytes to embeddings through the server against the reference (lab/bench/e2e_bench.py)
#   soak        10000 mixed requests at concurrency 16, memory sampled (lab/bench/soak.py)
#   profile     the encoder's kernels by GPU time (lab/bench/profile_encoder.py)
#   restart     a dead stub's full restart on the real-size checkpoint, timed (lab/bench/restart.py)
#   multiturn   chats that resend their images, the embedding cache on and off (lab/bench/multiturn.py)
#   batchdep    whether a media's rows depend on what it was batched with (lab/bench/batch_dependence.py)
#   attntiles   attention at head dim 72: flash-attn-4 as given, padded to 80, the other backends (lab/bench/attention_tiles.py)
# Carry what the machine lacks: .whl/gpu and .whl/perf, made by lab/pack_gpu_wheels.sh; .whl/nixl (--nixl) beside
# .whl/gpu for the NIXL pull's GPU test and e2e row (GPU_TESTS=tests/gpu/test_nixl_gpu.py bash lab/gpu.sh tests e2e).
set -uo pipefail
out=/tmp/results; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [[ ! -d /tmp/site/pytriton && -d .whl/gpu ]]; then
  mkdir -p /tmp/site && tar -xJf .whl/gpu/pytriton-slim.tar.xz -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/tritonclient-*.whl \
    .whl/gpu/python_rapidjson-*.whl || exit 1
fi
if [[ ! -d /tmp/np1/numpy && -d .whl/gpu ]]; then
  # numpy < 2 for the tritonserver stub only (KIMI_STUB_SITE, docs/triton_runtime.md); the host's own
  # Python (transformers) keeps its numpy 2.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/np1 .whl/gpu/numpy-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD KIMI_STUB_SITE=/tmp/np1
if [[ -d /tmp/fa4/flash_attn ]]; then export PYTHONPATH=$PYTHONPATH:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages; fi
if [[ ! -d /tmp/nixl/nixl_cu13 && -d .whl/nixl ]]; then
  mkdir -p /tmp/nixl && tar -xJf .whl/nixl/nixl-cu13-slim.tar.xz -C /tmp/nixl || exit 1
fi
if [[ -d /tmp/nixl/nixl_cu13 ]]; then export PYTHONPATH=$PYTHONPATH:/tmp/nixl; fi
perf_setup() {
  export LD_LIBRARY_PATH=/tmp/perf/b64/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  [[ -x /tmp/perf/bin/perf_analyzer ]] && return 0  # a warm machine's, from an earlier call
  mkdir -p /tmp/perf/bin
  python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.whl/perf/perf_analyzer.xz'), open('/tmp/perf/bin/perf_analyzer','wb'))"
  chmod +x /tmp/perf/bin/perf_analyzer
  dpkg -x .whl/perf/libb64-0d_*.deb /tmp/perf/b64
  python3 -m pip install -q --no-index --no-deps --target /tmp/perf .whl/perf/nvidia_cuda_runtime_cu12-*.whl
}
random_checkpoint() {  # written once per machine; config.json comes last, so its presence means complete
  [[ -f /tmp/kimi-random/config.json ]] || python3 -m oracles.random_checkpoint /tmp/kimi-random > /dev/null
}
save() {  # after every stage: a call cut short still returns what is done
  cp build/tritonserver-*.log "$out/" 2> /dev/null
  [[ -n "${OUT:-}" ]] || return 0
  cp lab/results/*.md "$OUT/" 2> /dev/null
  cp "$out"/*.log "$out/gpu.txt" "$OUT/" 2> /dev/null
  tar -czf "$OUT/results.tgz" -C "$out" .
}
rm -f "$out"/*.log  # a warm machine's earlier call must not pass for this one's
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, PIL, numpy, transformers; print('torch', torch.__version__, 'pillow', PIL.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__)"
  python3 -c "import torch; from backends.encoder.attention import available_backends; print('attention backends:', available_backends(torch.device('cuda'), torch.bfloat16))"
  [[ -d /tmp/fa4/flash_attn ]] || echo "flash-attn-4 is not installed: run the fa4 stage first, carrying .whl/fa4 (every GPU figure is taken with it)"
} 2>&1 | tee "$out/gpu.txt"
for stage in "$@"; do
  case $stage in
    fa4)
      [[ -d /tmp/fa4/flash_attn ]] || { mkdir -p /tmp/fa4 && tar -xJf .whl/fa4/fa4-site.tar.xz -C /tmp/fa4; } \
        && echo "fa4 installed"
      export PYTHONPATH=$PYTHONPATH:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages ;;
    tests)
      suite=${GPU_TESTS:-tests/gpu tests/unit/test_bicubic_vs_pillow.py}
      python3 -m pytest -q -p no:cacheprovider $suite > "$out/gpu_tests.log" 2>&1
      grep -E "passed|failed|^E  " "$out/gpu_tests.log" | head -40
      # The summary line, with what ran and on which tree, as the page's gpu-tests section (a run of
      # GPU_TESTS alone as gpu-tests-selected, so that it never stands for the whole suite).
      { echo "python3 -m pytest -q $suite  (bash lab/gpu.sh ... tests; tree $(git rev-parse --short HEAD 2> /dev/null || echo unknown))"
        echo; sed -n 3p "$out/gpu.txt"  # the backends as the tests saw them (a fa4 stage may precede)
        python3 -c "import torch; from backends.encoder.attention import available_backends; print('attention backends:', available_backends(torch.device('cuda'), torch.bfloat16))"; echo
        grep -E "^(FAILED|ERROR) " "$out/gpu_tests.log" | head -20
        grep -E "[0-9]+ (passed|failed)" "$out/gpu_tests.log" | tail -1
      } | python3 -m lab.bench.results_page section gpu "gpu-tests${GPU_TESTS:+-selected}" > /dev/null ;;
    encoder) python3 -m lab.bench.encoder_bench --out "$out" > "$out/encoder.log" 2>&1; tail -30 "$out/encoder.log" ;;
    preprocess) python3 -m lab.bench.preprocess_bench --out "$out" > "$out/preprocess.log" 2>&1; tail -20 "$out/preprocess.log" ;;
    decode) python3 -m lab.bench.decode_bench --out "$out" > "$out/decode.log" 2>&1; tail -20 "$out/decode.log" ;;
    perf|perf3000)
      perf_setup; random_checkpoint
      if [[ $stage == perf ]]; then runs="1024:1,16 8x448:1,16"; else runs="3000:1,4"; fi
      for run in $runs; do
        images=${run%%:*}
        python3 -m lab.bench.perf --device gpu --checkpoint /tmp/kimi-random --perf-dir /tmp/perf --measurement-ms ${PERF_MS:-4000} \
          --shared-memory cuda --encoder-alone --images $images --concurrency ${run#*:} \
          --ensembles ${PERF_ENSEMBLES:-plain,batched} --out "$out/perf-$images" --section "perf-$images" > "$out/perf_$images.log" 2>&1
        tail -16 "$out/perf_$images.log"
      done ;;
    mixed) random_checkpoint
      python3 -m lab.bench.mixed_sizes --device gpu --checkpoint /tmp/kimi-random --section mixed_sizes > "$out/mixed.log" 2>&1
      grep -v "^[IWE]1[0-9]" "$out/mixed.log" | tail -8
      grep -hiE "captured|graphs|warmed|failed|of our own" build/tritonserver-mixed*.log 2> /dev/null | cut -c1-300 | head -12 ;;
    firsttime) random_checkpoint  # where a size's first time goes, in one process (lazy and eager CUDA modules)
      python3 -m lab.bench.first_time --checkpoint /tmp/kimi-random > "$out/first_time.log" 2>&1
      [[ ${FIRSTTIME_EAGER:-1} == 0 ]] || CUDA_MODULE_LOADING=EAGER python3 -m lab.bench.first_time --checkpoint /tmp/kimi-random > "$out/first_time_eager.log" 2>&1
      grep -hE "^CUDA_MODULE|^median|loaded in|warmed|captured|^GPU memory|^[0-9]+x[0-9]+:" "$out"/first_time*.log ;;
    e2e) random_checkpoint
      python3 -m lab.bench.e2e_bench --checkpoint /tmp/kimi-random --out "$out" > "$out/e2e.log" 2>&1; tail -20 "$out/e2e.log" ;;
    soak)
      python3 -m lab.bench.soak --device gpu --requests 10000 --concurrency 16 --sample-every 1000 --out "$out" \
        --section soak > "$out/soak.log" 2>&1; grep -v "^[IWE]1[0-9]" "$out/soak.log" | tail -30 ;;
    restart) random_checkpoint
      python3 -m lab.bench.restart --device gpu --checkpoint /tmp/kimi-random --section restart > "$out/restart.log" 2>&1
      grep -v "^[IWE]1[0-9]" "$out/restart.log" | tail -8 ;;
    multiturn) random_checkpoint
      python3 -m lab.bench.multiturn --device gpu --checkpoint /tmp/kimi-random --section multiturn ${MULTITURN_ARGS:-} \
        > "$out/multiturn.log" 2>&1; grep -v "^[IWE]1[0-9]" "$out/multiturn.log" | tail -14 ;;
    batchdep) python3 -m lab.bench.batch_dependence --section batch_dependence > "$out/batchdep.log" 2>&1
      tail -20 "$out/batchdep.log" ;;
    attntiles) python3 -m lab.bench.attention_tiles --section attention_tiles > "$out/attntiles.log" 2>&1
      grep -v Warning "$out/attntiles.log" | tail -20 ;;
    profile) python3 -m lab.bench.profile_encoder --out "$out" --section profile > "$out/profile.log" 2>&1; head -60 "$out/profile.log" ;;
    *) echo "unknown stage '$stage' (the stages are listed at the top of lab/gpu.sh)" >&2 ;;
  esac
  save
done
