#!/usr/bin/env bash
# Everything we run on the GPU machine, in stages, writing results under /tmp/results (summaries and one
# results.tgz copied to $OUT where the device tool sets it).
#   bash lab/gpu.sh tests   # GPU tests (kernels, encoder, ensemble on tritonserver)
#   bash lab/gpu.sh bench   # encoder, RoPE and preprocessing benchmarks (encoder / rope: parts)
#   bash lab/gpu.sh perf    # random real-size checkpoint -> e2e (ours vs reference) + perf_analyzer
#   (perf = e2e then perfanalyzer; run those two stages as separate calls if one call must stay short)
#   stages also: decode (exact GPU JPEG decode vs Pillow), stages (stage breakdown + stub profiles),
#   (STAGE_ARGS adds arguments to stages' stage_bench, e.g. "--profile-case 8x448^2"),
#   soak (10000 mixed requests at concurrency 16), profile (encoder kernel table), servertests (tests/gpu/test_gpu_server.py only; PYTEST_K selects),
#   perf2enc (1024^2 at c=16 with two encoder instances), fusedperf (plain ensemble against kimi_k25_vision_fused), stubprobe (tensors through a one-model server, stub on numpy<2 vs the host's numpy),
#   fa4a / fa4b (flash-attn-4 in two carries), attnprobe (which SDPA kernel runs, here and in the stub's env),
#   preprobe (preprocessing call by call, and after idle gaps: tools/preprocess_probe.py),
#   scanprobe (the JPEG scan check per thread count, its phases, and threaded against one-thread verdicts),
#   mps (1024^2 at c=16 without, then with CUDA MPS; MPS_IMAGES, MPS_CONCURRENCY, MPS_VARIANTS),
#   sustained (the encoder alone in a burst and under sustained load, with the SM clock: lab/bench/encoder_sustained.py),
#   cpulat (the stage table, or with CPULAT_BENCH=perf perf_analyzer 8x448^2 at c=1, without / with / without
#   backends/deploy/cpu_latency holding the CPU wake-up latency limit at 0; CPULAT_VARIANTS picks other orders),
#   launcher (the launcher on the GPU, LAUNCHER_ARGS default --cpu-latency-us 0 --mps --encoder-instances 2:
#   holds the limit, runs its MPS daemon, answers, stops),
#   envab (perf_analyzer A/B/A/B runs that differ in one environment setting: ENVAB_VARIANTS, ENVAB_IMAGES,
#   ENVAB_CONCURRENCY; default 8x448^2 at concurrency 1),
#   memprobe (device memory across the soak's requests in one process, no server: tools/memory_probe.py),
#   senderrace (python_backend's response sender from a thread, with a tiny model: tools/sender_race_probe.py),
#   hunt (the fused pipeline's rare hang, hunted with perf_analyzer: HUNT_RUNS, HUNT_IMAGES, HUNT_CONCURRENCY),
#   timeline (GPU busy and idle inside the fused model at 16 against the encoder alone: tools/gpu_timeline.py),
#   lanesprobe (the fused model's answers at concurrency 16 against one at a time, real size: tools/lanes_probe.py)
# Carry what the host lacks: .whl/gpu and .whl/perf, made by lab/pack_gpu_wheels.sh (under 64 MiB).
# Results go to a scratch folder; $OUT receives the tables and one results.tgz (logs, CSV, JSON).
set -uo pipefail
out=/tmp/results; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [[ ! -d /tmp/site/pytriton && -d .whl/gpu ]]; then
  mkdir -p /tmp/site && tar -xJf .whl/gpu/pytriton-slim.tar.xz -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/tritonclient-*.whl \
    .whl/gpu/python_rapidjson-*.whl || exit 1
fi
if [[ ! -d /tmp/np1/numpy && -d .whl/gpu ]]; then
  # numpy < 2 for the tritonserver stub only (it misreads BYTES inputs under numpy 2); the host's own
  # Python (transformers) keeps its numpy 2.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/np1 .whl/gpu/numpy-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD KIMI_STUB_SITE=/tmp/np1
# flash-attn-4 (optional, lab/pack_gpu_wheels.sh --fa4): its 92 MB library comes in two
# calls, stages fa4a then fa4b, while the machine stays warm.
if [[ -d /tmp/fa4/flash_attn ]]; then export PYTHONPATH=$PYTHONPATH:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages; fi
perf_setup() {
  mkdir -p /tmp/perf/bin
  python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.whl/perf/perf_analyzer.xz'), open('/tmp/perf/bin/perf_analyzer','wb'))"
  chmod +x /tmp/perf/bin/perf_analyzer
  dpkg -x .whl/perf/libb64-0d_*.deb /tmp/perf/b64
  python3 -m pip install -q --no-index --no-deps --target /tmp/perf .whl/perf/nvidia_cuda_runtime_cu12-*.whl
  export LD_LIBRARY_PATH=/tmp/perf/b64/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
}
random_checkpoint() {  # written once per machine; config.json comes last, so its presence means complete
  [[ -f /tmp/kimi-random/config.json ]] || python3 -m oracles.random_checkpoint /tmp/kimi-random > /dev/null
}
e2e() {
  random_checkpoint
  python3 -m lab.bench.e2e_bench --checkpoint /tmp/kimi-random --out "$out" > "$out/e2e_bench.log" 2>&1
  tail -28 "$out/e2e_bench.log"
}
# bench.perf as every perf_analyzer stage runs it: the random checkpoint, the encoder alone measured in the
# same run, CUDA shared memory for the outputs, 3 s windows; each stage adds images, levels, ensembles, out.
PERF=(python3 -m lab.bench.perf --device gpu --checkpoint /tmp/kimi-random --perf-dir /tmp/perf --measurement-ms 3000
      --shared-memory cuda --encoder-alone)
perfanalyzer() {  # both ensembles, CUDA shared memory for the outputs, the encoder alone in the same run
  perf_setup; random_checkpoint
  for images in 1024 8x448; do
    rm -rf "$out/perf-$images"  # a warm machine's earlier summary must not pass for this run's
    "${PERF[@]}" --images $images --concurrency 1,4,16 --ensembles plain,batched \
      --out "$out/perf-$images" > "$out/perf_gpu_$images.log" 2>&1
    grep -E "^perf_analyzer (exited|timed out)|^error" "$out/perf_gpu_$images.log" | head -8
    cat "$out/perf-$images/perf_summary.md" >> "$out/perf_gpu.md" || tail -20 "$out/perf_gpu_$images.log"
  done
  cat "$out/perf_gpu.md"
}
SUMMARIES="timeline.md sender_race.md launcher.md encoder_sustained.md gpu_tests.log decode_bench.md stage_bench.md stage_cpulat.md perf_gpu.md soak_gpu.md e2e_bench.md preprocess_probe.md memory_probe.md scan_check_probe.md lanes_probe.md"
# A warm machine keeps /tmp/results from an earlier call: its summaries must neither come back as this
# call's nor crowd this call's out of the device tool's few returned files (perf_gpu.md collects every
# perf_analyzer stage of one call).
for f in $SUMMARIES; do rm -f "$out/$f"; done
save() {  # few files come back (the device tool's limit): the summaries, and everything in one archive
  cp build/tritonserver-*.log "$out/" 2>/dev/null
  [[ -n "${OUT:-}" ]] || return 0
  for f in $SUMMARIES; do
    [[ -f "$out/$f" ]] && cp "$out/$f" "$OUT/"
  done
  tar -czf "$OUT/results.tgz" -C "$out" .
}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,pstate,power.draw --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, PIL, numpy, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'pillow', PIL.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
for stage in "$@"; do
  case $stage in
    servertests)
      python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_server.py ${PYTEST_K:+-k "$PYTEST_K"} \
        > "$out/gpu_server_tests.log" 2>&1
      grep -E "passed|failed|^E  " "$out/gpu_server_tests.log" | head -20 ;;
    stubprobe) python3 -m lab.tools.stub_probe --label stub-np1 2>&1 | grep STUB_PROBE | cut -c1-220
      KIMI_STUB_SITE= python3 -m lab.tools.stub_probe --allow-numpy2 --label host-numpy 2>&1 | grep STUB_PROBE | cut -c1-220 ;;
    fa4a) mkdir -p /tmp/fa4parts && cp .whl/fa4a/cu13part.aa /tmp/fa4parts/ && ls -la /tmp/fa4parts ;;
    fa4b)
      cat /tmp/fa4parts/cu13part.aa .whl/fa4b/cu13part.ab > /tmp/fa4parts/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4 .whl/fa4b/*.whl /tmp/fa4parts/*.whl && echo fa4 installed ;;
    tests)
      python3 -m pytest -q -s -p no:cacheprovider tests/gpu tests/unit/test_bicubic_vs_pillow.py > "$out/gpu_tests.log" 2>&1
      grep -E "passed|failed|^E  " "$out/gpu_tests.log" | head -60 ;;
    profile)
      python3 -m lab.bench.profile_encoder --out "$out" 2>&1 | grep -E "^##|Self CUDA time total|^ *[a-zA-Z_:<>]" | head -90 ;;
    rope) python3 -m lab.bench.encoder_bench --rope-only --out "$out/rope" 2>&1 | tail -12 ;;
    encoder) python3 -m lab.bench.encoder_bench --out "$out" 2>&1 | tail -40 ;;
    bench)
      python3 -m lab.bench.encoder_bench --out "$out" 2>&1 | tail -40
      python3 -m lab.bench.preprocess_bench --out "$out" 2>&1 | tail -40 ;;
    e2e) e2e ;;
    perfanalyzer) perfanalyzer ;;
    fusedperf)  # the plain ensemble against kimi_k25_vision_fused, side by side in one server (FUSED_IMAGES,
      # default "8x448 1024"; FUSED_CONCURRENCY, default 1)
      perf_setup; random_checkpoint
      for images in ${FUSED_IMAGES:-8x448 1024}; do
        rm -rf "$out/perf-fused-$images"  # a warm machine's earlier summary must not pass for this run's
        timeout -s INT -k 60 240 "${PERF[@]}" --images $images --concurrency ${FUSED_CONCURRENCY:-1} \
          --ensembles plain,fused --out "$out/perf-fused-$images" > "$out/perf_gpu_fused_$images.log" 2>&1
        cat "$out/perf-fused-$images/perf_summary.md" >> "$out/perf_gpu.md" || tail -20 "$out/perf_gpu_fused_$images.log"
        save
      done
      cat "$out/perf_gpu.md" ;;
    perf2enc)  # one 1024^2 JPEG per request at concurrency 16 with two moonvit3d instances on the GPU
      perf_setup; random_checkpoint
      rm -rf "$out/perf-1024-2enc"  # a warm machine's earlier summary must not pass for this run's
      "${PERF[@]}" --images 1024 --concurrency 16 --ensembles plain,batched --encoder-instances 2 \
        --out "$out/perf-1024-2enc" > "$out/perf_gpu_1024_2enc.log" 2>&1
      cat "$out/perf-1024-2enc/perf_summary.md" >> "$out/perf_gpu.md" || tail -20 "$out/perf_gpu_1024_2enc.log"
      cat "$out/perf-1024-2enc/perf_summary.md" ;;
    mps)  # 1024^2 at c=16, plain ensemble, without and then with CUDA MPS (the processes' kernels may
      # then share the GPU instead of taking turns): lab/bench/perf.py --mps runs its server under a daemon of
      # its own (backends/deploy/mps.py) and stops it after. MPS_IMAGES=8x448 and MPS_CONCURRENCY=1,16
      # choose other requests and levels; MPS_VARIANTS picks the runs, in order (default "no-mps mps"; a
      # variant ending in -2enc runs two moonvit3d instances). MPS_ENSEMBLES=plain,fused adds the fused model.
      perf_setup; random_checkpoint
      one_mps_run() {
        local tag=${MPS_IMAGES:-1024}-$1 extra=()
        [[ $1 == *-2enc ]] && extra+=(--encoder-instances 2)
        [[ $1 == mps* ]] && extra+=(--mps)
        rm -rf "$out/perf-$tag"  # a warm machine's earlier summary must not pass for this run's
        # SIGINT, not SIGTERM: Python unwinds and the server it started is stopped with it (and its daemon).
        # -k 90: the server's drain (up to ~35 s) and the daemon's stop (up to 30 s) come before a kill.
        timeout -s INT -k 90 200 "${PERF[@]}" --images ${MPS_IMAGES:-1024} --concurrency ${MPS_CONCURRENCY:-16} \
          --ensembles ${MPS_ENSEMBLES:-plain} "${extra[@]}" --out "$out/perf-$tag" > "$out/perf_gpu_$tag.log" 2>&1
        if [[ -f "$out/perf-$tag/perf_summary.md" ]]; then
          { echo "### $1"; cat "$out/perf-$tag/perf_summary.md"; } >> "$out/perf_gpu.md"
        else
          { echo "### $1: no summary"; tail -20 "$out/perf_gpu_$tag.log"; } | tee -a "$out/perf_gpu.md"
        fi
        if [[ $1 == mps* ]]; then  # did the run's daemon go? (a leftover refuses the next run's)
          { echo "MPS processes left on bench.perf's pipe folder: $(python3 -c "from backends.deploy import mps
print(len(mps.daemon_pids(mps.Daemon.under(mps.folder_for('perf')).pipe_dir)))")"
            tail -5 "$(python3 -c "from backends.deploy import mps; print(mps.Daemon.under(mps.folder_for('perf')).log_dir / 'control.log')")" 2> /dev/null
          } | tee -a "$out/perf_gpu.md"
        fi
        save  # each run's results come back even if a later run hangs past the call's limit
      }
      for v in ${MPS_VARIANTS:-no-mps mps}; do
        if [[ $v =~ ^(no-mps|mps)(-2enc)?$ ]]; then one_mps_run "$v"
        else echo "MPS_VARIANTS: '$v' names no run (no-mps[-2enc] or mps[-2enc])" | tee -a "$out/perf_gpu.md"; fi
      done
      cat "$out/perf_gpu.md" ;;
    envab)  # perf_analyzer runs that differ only in one environment setting, alternated (A/B/A/B): each
      # word of ENVAB_VARIANTS is a NAME=VALUE the server of that run gets, e.g. "KIMI_GPU_JPEG=1
      # KIMI_GPU_JPEG=0 KIMI_GPU_JPEG=1 KIMI_GPU_JPEG=0"; ENVAB_IMAGES (8x448) and ENVAB_CONCURRENCY (1)
      # choose the requests.
      perf_setup; random_checkpoint
      i=0
      [[ -n ${ENVAB_VARIANTS:-} ]] || echo "envab: ENVAB_VARIANTS is empty, nothing to run" | tee -a "$out/perf_gpu.md"
      for v in ${ENVAB_VARIANTS:-}; do
        i=$((i + 1)); run="$out/envab-$i"; rm -rf "$run" "$run.log"
        [[ $v =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { echo "ENVAB_VARIANTS: '$v' is not NAME=VALUE" | tee -a "$out/perf_gpu.md"; continue; }
        env "$v" timeout -s INT -k 60 150 "${PERF[@]}" --images ${ENVAB_IMAGES:-8x448} \
          --concurrency ${ENVAB_CONCURRENCY:-1} --ensembles plain --out "$run" > "$run.log" 2>&1
        { echo "### $i: $v"; cat "$run/perf_summary.md" 2> /dev/null || tail -5 "$run.log"; echo; } >> "$out/perf_gpu.md"
        save
      done
      cat "$out/perf_gpu.md" ;;
    perf) e2e; perfanalyzer ;;
    decode) python3 -m lab.bench.decode_bench --out "$out" > "$out/decode_bench.log" 2>&1; tail -25 "$out/decode_bench.log" ;;
    stages) random_checkpoint
      python3 -m lab.bench.stage_bench --checkpoint /tmp/kimi-random --out "$out" --profile ${STAGE_ARGS:-} > "$out/stage_bench.log" 2>&1
      tail -30 "$out/stage_bench.log"
      for f in "$out"/profile/moonvit3d-*.txt "$out"/profile/kimi_preprocess-*.txt; do
        [[ -f $f ]] && head -22 "$f" | cut -c1-58,100-140
      done ;;
    cpulat)  # without, with and again without backends/deploy/cpu_latency holding the CPU wake-up latency
      # limit at 0: the stage table, or with CPULAT_BENCH=perf perf_analyzer's 8x448^2 at concurrency 1.
      # CPULAT_VARIANTS picks the runs in order (without or with the hold).
      random_checkpoint; : > "$out/stage_cpulat.md"
      case ${CPULAT_BENCH:-stages} in
        perf) perf_setup ;;
        stages) ;;
        *) echo "CPULAT_BENCH: '$CPULAT_BENCH' is neither stages nor perf" | tee -a "$out/stage_cpulat.md" ;;
      esac
      lscpu | grep -E "^(Model name|Thread\(s\) per core|Core\(s\) per socket|Hypervisor vendor)" | tee -a "$out/stage_cpulat.md"
      i=0
      for v in ${CPULAT_VARIANTS:-without with without}; do
        i=$((i + 1)); holder=; run="$out/cpulat-$i-$v"
        rm -rf "$run" "$run.log"  # a warm machine's earlier run must not pass for this one
        case $v in
          without) ;;
          with) python3 -m backends.deploy.cpu_latency & holder=$! ;;
          *) echo "CPULAT_VARIANTS: '$v' is neither without nor with" | tee -a "$out/stage_cpulat.md"; continue ;;
        esac
        if [[ -n $holder ]]; then
          sleep 1
          kill -0 $holder 2> /dev/null || { echo "$v: its helper did not start" | tee -a "$out/stage_cpulat.md"; continue; }
        fi
        if [[ ${CPULAT_BENCH:-stages} == perf ]]; then
          timeout -s INT -k 30 150 "${PERF[@]}" --images 8x448 --concurrency 1 --ensembles plain \
            --out "$run" > "$run.log" 2>&1
          { echo "### $i: $v"; cat "$run/perf_summary.md" 2> /dev/null || tail -5 "$run.log"; echo; } >> "$out/stage_cpulat.md"
        else
          timeout -s INT -k 30 200 python3 -m lab.bench.stage_bench --checkpoint /tmp/kimi-random --out "$run" \
            ${STAGE_ARGS:-} > "$run.log" 2>&1
          { echo "### $i: $v"; grep -E "^\|( case|---| 1x| 8x)" "$run.log"; echo; } >> "$out/stage_cpulat.md"
        fi
        [[ -n $holder ]] && { kill $holder; wait $holder 2> /dev/null; }
      done
      cat "$out/stage_cpulat.md" ;;
    sustained) random_checkpoint  # SUSTAINED_ARGS adds arguments, e.g. "--images 8x448 --seconds 30"
      python3 -m lab.bench.encoder_sustained --checkpoint /tmp/kimi-random --out "$out" ${SUSTAINED_ARGS:-} \
        > "$out/encoder_sustained.log" 2>&1
      tail -40 "$out/encoder_sustained.log" ;;
    launcher)  # `make serve`'s launcher itself on the GPU with LAUNCHER_ARGS (default: the CPU wake-up latency
      # hold, its own MPS daemon, two encoder instances; LAUNCHER_ARGS= for none): ready, the descriptor
      # held, the MPS server up, one sample request answered, a clean stop on SIGINT that takes the daemon
      # (the processes of its pipe folder, backends/deploy/mps.py daemon_pids) with it
      largs=${LAUNCHER_ARGS-"--cpu-latency-us 0 --mps --encoder-instances 2"}
      mps_left() { python3 -c "from backends.deploy import mps; print(len(mps.daemon_pids(mps.Daemon.under(mps.folder_for('$1')).pipe_dir)))"; }
      python3 -m backends.deploy.launcher --device gpu $largs --address 127.0.0.1 --http-port 8300 --grpc-port 8301 \
        --metrics-port 8302 > "$out/launcher.log" 2>&1 & launcher=$!
      ready=no
      for _ in $(seq 90); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8300/v2/health/ready', timeout=2)" \
          2> /dev/null && { ready=yes; break; }
        kill -0 $launcher 2> /dev/null || break; sleep 2
      done
      { echo "\$ python -m backends.deploy.launcher --device gpu $largs"
        echo "ready: $ready"
        grep -E 'CPU wake-up|MPS|warning' "$out/launcher.log" | head -5
        echo "descriptors on /dev/cpu_dma_latency: $(ls -l /proc/$launcher/fd 2> /dev/null | grep -c cpu_dma_latency)"
        echo "MPS processes on the launcher's pipe folder while serving: $(mps_left 8301)" \
          "(on the machine: control $(pgrep -c -f 'nvidia-cuda-mps-control'), server $(pgrep -c -f '^nvidia-cuda-mps-server'))"
        # mps.daemon_pids relies on the MPS server carrying the pipe folder in its environment (seen in the
        # eighth session, call 2); printed, so that a driver that stops doing so shows here.
        server_pid=$(pgrep -o -f '^nvidia-cuda-mps-server')
        [[ -n $server_pid ]] && echo "MPS server's environment: $(tr '\0' '\n' < /proc/$server_pid/environ | grep '^CUDA_MPS' | tr '\n' ' ')"
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | head -12
        python3 -c "from clients.kimi_client import KimiVisionClient, chat_prompt_ids; from clients.samples import sample_images
i = sample_images(); c = KimiVisionClient('localhost:8301', protocol='grpc'); print(c.infer(chat_prompt_ids(len(i)), i).summary())"
        kill -INT $launcher; } 2>&1 | tee "$out/launcher.md"
      wait $launcher; echo "launcher exit status $?" | tee -a "$out/launcher.md"
      echo "MPS processes on the launcher's pipe folder after the stop: $(mps_left 8301)" \
        "(on the machine: control $(pgrep -c -f 'nvidia-cuda-mps-control'), server $(pgrep -c -f '^nvidia-cuda-mps-server'))" \
        | tee -a "$out/launcher.md" ;;
    memprobe) python3 -m lab.tools.memory_probe > "$out/memory_probe.md" 2>&1; tail -20 "$out/memory_probe.md" ;;
    preprobe) python3 -m lab.tools.preprocess_probe > "$out/preprocess_probe.md" 2>&1; cat "$out/preprocess_probe.md" ;;
    senderrace)  # python_backend's response sender from a worker thread, no model of ours (tools/sender_race_probe.py):
      # SENDER_RACE_VARIANTS, ';'-separated argument sets, each run SENDER_RACE_SECONDS (default 120)
      IFS=';' read -ra variants <<< "${SENDER_RACE_VARIANTS:---ask --gpu-output;--no-ask --gpu-output}"
      i=0
      for v in "${variants[@]}"; do
        i=$((i + 1))
        { echo "### $v"; timeout -s INT -k 30 $(( ${SENDER_RACE_SECONDS:-120} + 120 )) python3 -m lab.tools.sender_race_probe \
            --seconds ${SENDER_RACE_SECONDS:-120} --out "$out/race-$i" $v 2>&1 | grep -v "^[IWE]1[0-9]"; echo; } \
          >> "$out/sender_race.md"
        [[ -n "${OUT:-}" && -d "$out/race-$i" ]] && cp -r "$out/race-$i" "$OUT/"
      done
      cat "$out/sender_race.md" ;;
    hunt)  # the fused pipeline's rare hang (docs/triton_runtime.md): HUNT_RUNS perf_analyzer runs of HUNT_IMAGES
      # (default 8x448) at HUNT_CONCURRENCY (16) against kimi_k25_vision_fused, pipeline on, in one server. A
      # timeout writes the native stacks and stops the rest; the watchdog's Python stacks are in the server's log.
      perf_setup; random_checkpoint
      rm -rf "$out/perf-hunt"
      levels=$(printf "${HUNT_CONCURRENCY:-16},%.0s" $(seq ${HUNT_RUNS:-10})); levels=${levels%,}
      timeout -s INT -k 60 ${HUNT_TIMEOUT:-540} "${PERF[@]}" --images ${HUNT_IMAGES:-8x448} --concurrency $levels \
        --ensembles fused --fused-pipeline --run-timeout ${HUNT_RUN_TIMEOUT:-75} --out "$out/perf-hunt" \
        > "$out/perf_gpu_hunt.log" 2>&1
      grep -E "^perf_analyzer (exited|timed out)|^native stacks|^error" "$out/perf_gpu_hunt.log" | head -8
      cat "$out/perf-hunt/perf_summary.md" >> "$out/perf_gpu.md" || tail -20 "$out/perf_gpu_hunt.log"
      [[ -n "${OUT:-}" ]] && cp "$out"/perf-hunt/native_stacks_*.txt "$OUT/" 2>/dev/null
      cat "$out/perf_gpu.md" ;;
    timeline)  # is the GPU idle between the fused model's forwards at concurrency 16, or are they slower than
      # the encoder alone's? A torch profiler window (TIMELINE_CALLS requests after 300) inside the fused model,
      # pipeline on, TIMELINE_IMAGES (default 8x448), once per lane count in TIMELINE_LANES (default "1 2"); and
      # the encoder alone traced the same way. tools/gpu_timeline.py summarizes each, lists the longest idle
      # gaps with what launched the work after them, and sets the kernels beside the encoder alone's.
      perf_setup; random_checkpoint
      calls=${TIMELINE_CALLS:-40} images=${TIMELINE_IMAGES:-8x448}
      rm -rf "$out/prof"; mkdir -p "$out/prof"
      python3 -m lab.tools.gpu_timeline --encoder-alone "$out/prof/alone.json" --checkpoint /tmp/kimi-random \
        --images $images --alone-requests $calls 2>&1 | grep -v -i "warn" > "$out/timeline-alone.md"
      for lanes in ${TIMELINE_LANES:-1 2}; do
        rm -rf "$out/perf-timeline-$lanes" "$out"/prof/kimi_k25_vision_fused-*
        KIMI_PROFILE_DIR="$out/prof" KIMI_PROFILE_TRACE=1 KIMI_PROFILE_SKIP=300 KIMI_PROFILE_CALLS=$calls \
          timeout -s INT -k 60 240 "${PERF[@]}" --images $images --concurrency 16 --ensembles fused \
          --fused-pipeline --fused-lanes $lanes --out "$out/perf-timeline-$lanes" > "$out/perf_gpu_timeline_$lanes.log" 2>&1
        cat "$out/perf-timeline-$lanes/perf_summary.md" >> "$out/perf_gpu.md" || tail -20 "$out/perf_gpu_timeline_$lanes.log"
        echo "## $images at 16, pipeline on, $lanes lane(s)" >> "$out/timeline.md"
        trace=$(ls "$out"/prof/kimi_k25_vision_fused-*.json 2> /dev/null | head -1)
        if [[ -n "$trace" ]]; then
          python3 -m lab.tools.gpu_timeline "$trace" --requests $calls --compare "$out/prof/alone.json" \
            --compare-requests $calls >> "$out/timeline.md" 2>&1
        else echo "no trace written" >> "$out/timeline.md"; fi
        save
      done
      rm -f "$out"/prof/*.json  # large; the summaries carry what they say
      cat "$out/timeline.md" ;;
    lanesprobe) random_checkpoint  # the fused model's answers under load against one at a time, real size
      # SIGINT, not SIGTERM: the probe unwinds and stops its server (a SIGTERM left it running)
      # LANES_ARGS adds probe arguments, e.g. "--lanes 1 --cases 8x448" (one lane, that case first)
      timeout -s INT -k 60 ${LANES_TIMEOUT:-400} python3 -m lab.tools.lanes_probe --checkpoint /tmp/kimi-random \
        ${LANES_ARGS:-} > "$out/lanes_probe.md" 2>&1; tail -8 "$out/lanes_probe.md" ;;
    scanprobe)  # the JPEG scan check on this host's cores: time per thread count and phases, threaded verdicts
      { python3 -m lab.tools.scan_check_probe --phases 2>&1; python3 -m lab.tools.scan_check_probe --agreement 4 2>&1; } \
        > "$out/scan_check_probe.md"; grep -v "^threads" "$out/scan_check_probe.md" ;;
    attnprobe) python3 -m lab.tools.attention_probe --stub-env 2>&1 | grep -E "^ATTN|Error" | cut -c1-300 ;;
    soak) python3 -m lab.bench.soak --device gpu --requests 10000 --concurrency 16 --sample-every 1000 --out "$out" \
      > "$out/soak.log" 2>&1; grep -v "^[IWE]1[0-9]" "$out/soak.log" | tail -45 ;;
    *) echo "unknown stage '$stage' (the stages are listed at the top of lab/gpu.sh)" >&2 ;;
  esac
  save  # after every stage: a call cut short still returns what is done
done
