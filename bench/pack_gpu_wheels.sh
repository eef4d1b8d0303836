#!/usr/bin/env bash
# Pack what the GPU machine lacks into .whl/gpu (+ .whl/perf) so that one call carries it under 64 MiB:
# a slimmed nvidia-pytriton (the tritonserver binary, the Python backend and the 3.12 stub; the other
# Pythons' stubs and the bundled libpython3.13 dropped), numpy<2 for the 2.51 Python backend,
# tritonclient and python-rapidjson; and perf_analyzer (from the tritonclient 2.48 wheel, xz),
# libcudart 12 and libb64 for `gpu_session.sh perf`.
set -euo pipefail
dest=.whl; tmp=$(mktemp -d)
bash ../shared/tools/offline_wheels.sh "$tmp/w" >/dev/null
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$dest/gpu" "$dest/perf" "$tmp/pt"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest/gpu" numpy==1.26.4
cp "$tmp"/w/serve/tritonclient-*.whl "$tmp"/w/serve/python_rapidjson-*.whl "$dest/gpu/"
(cd "$tmp/pt" && unzip -q "$tmp"/w/serve/nvidia_pytriton-*.whl && rm -f nvidia_pytriton.libs/libpython3-*.so* \
  && find pytriton/tritonserver/python_backend_stubs -mindepth 1 -maxdepth 1 -type d ! -name 3.12 -exec rm -rf {} + \
  && tar -cf - . | xz -9 -T2 > "$OLDPWD/$dest/gpu/pytriton-slim.tar.xz")
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/p" tritonclient==2.48.0 nvidia-cuda-runtime-cu12==12.6.77
unzip -q -j -o "$tmp"/p/tritonclient-2.48.0-*.whl 'tritonclient-2.48.0.data/data/bin/perf_analyzer' -d "$tmp"
xz -9 -c "$tmp/perf_analyzer" > "$dest/perf/perf_analyzer.xz"
cp "$tmp"/p/nvidia_cuda_runtime_cu12-*.whl "$dest/perf/"
(cd "$dest/perf" && apt-get download libb64-0d)
rm -rf "$tmp"; du -sh "$dest"/gpu "$dest"/perf
