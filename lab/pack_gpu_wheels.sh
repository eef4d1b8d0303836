#!/usr/bin/env bash
# Pack what the GPU machine (air-gapped x86-64, Python 3.12, torch/numpy 2/pillow/transformers already
# installed) lacks, so that one call carries it under 64 MiB:
#   .whl/gpu   a slimmed nvidia-pytriton (the tritonserver binary, the Python backend and the 3.12 stub;
#              the other Pythons' stubs and the bundled libpython3.13 dropped), numpy<2 for the 2.51
#              Python backend, tritonclient and python-rapidjson;
#   .whl/perf  perf_analyzer (from the tritonclient 2.48 wheel, xz), libcudart 12 and libb64;
#   .whl/fa4   (with --fa4) flash-attn-4 and its CUTLASS DSL libraries, unpacked and packed again as one
#              xz archive with the x86 branch filter and a 256 MiB dictionary (55 MiB; as wheels 102 MB,
#              as plain xz -9e 64 MiB): one call carries it with the repo, or with .whl/perf (lab/gpu.sh
#              stage fa4). Packing takes about 5 minutes (one thread: the dictionary spans the archive);
#   .whl/nixl  (with --nixl) NIXL for the host's CUDA 13 torch (nixl-cu13, requirements.txt's nixl-cu12
#              version) slimmed to its UCX and POSIX plugins, without nixl_ep (56 MiB as a wheel, 11 MB so):
#              carried beside .whl/gpu in one call (lab/gpu.sh unpacks it).
# Usage: bash lab/pack_gpu_wheels.sh [--fa4] [--nixl]
set -euo pipefail
dest=.whl; tmp=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps "${plat[@]}" -d "$1" "${@:2}"; }
# The versions the server runs with are requirements.txt's: read them there, never repeat them here.
pin() { local p; p=$(sed -n -E "s/^($1)(\[[^]]*\])?==([^ #]+).*/\1==\3/p" requirements.txt)
        [[ -n $p ]] || { echo "requirements.txt pins no $1" >&2; exit 1; }; echo "$p"; }
mkdir -p "$dest/gpu" "$dest/perf" "$tmp/pt" "$tmp/w"
numpy=$(pin numpy); client=$(pin tritonclient); pytriton=$(pin nvidia-pytriton)  # set -e stops on a missing pin
get "$dest/gpu" "$numpy" "$client" python-rapidjson
get "$tmp/w" "$pytriton"
(cd "$tmp/pt" && unzip -q "$tmp"/w/nvidia_pytriton-*.whl && rm -f nvidia_pytriton.libs/libpython3-*.so* \
  && find pytriton/tritonserver/python_backend_stubs -mindepth 1 -maxdepth 1 -type d ! -name 3.12 -exec rm -rf {} + \
  && tar -cf - . | xz -9 -T2 > "$OLDPWD/$dest/gpu/pytriton-slim.tar.xz")
get "$tmp/p" tritonclient==2.48.0 nvidia-cuda-runtime-cu12==12.6.77
unzip -q -j -o "$tmp"/p/tritonclient-2.48.0-*.whl 'tritonclient-2.48.0.data/data/bin/perf_analyzer' -d "$tmp"
xz -9 -c "$tmp/perf_analyzer" > "$dest/perf/perf_analyzer.xz"
cp "$tmp"/p/nvidia_cuda_runtime_cu12-*.whl "$dest/perf/"
(cd "$dest/perf" && apt-get download libb64-0d)
if [[ " $* " == *" --nixl "* ]]; then
  mkdir -p "$dest/nixl" "$tmp/nixl" "$tmp/nx"
  get "$tmp/nixl" "nixl-cu13==$(pin nixl-cu12 | cut -d= -f3)"
  (cd "$tmp/nx" && unzip -q "$tmp"/nixl/nixl_cu13-*.whl && rm -rf nixl_ep_cu13 nixl_cu13-*.data nixl_cu13.scripts \
    && find . -name 'libplugin_*.so' ! -name '*UCX*' ! -name '*POSIX*' -delete \
    && rm -f nixl_cu13.libs/lib{aws,azure,s2n,gusli,xml2,curl}* \
    && tar -cf - . | xz -6 -T2 > "$OLDPWD/$dest/nixl/nixl-cu13-slim.tar.xz")
fi
if [[ " $* " == *" --fa4 "* ]]; then
  mkdir -p "$dest/fa4" "$tmp/fa4" "$tmp/fa4site"
  get "$tmp/fa4" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels apache-tvm-ffi torch-c-dlpack-ext
  # Pure wheels with no .data folders: unzipped they are what `pip install --target` makes.
  for w in "$tmp"/fa4/*.whl; do unzip -q -o "$w" -d "$tmp/fa4site"; done
  (cd "$tmp/fa4site" && tar --sort=name -cf - . | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$OLDPWD/$dest/fa4/fa4-site.tar.xz")
fi
rm -rf "$tmp"; du -sh "$dest"/*
