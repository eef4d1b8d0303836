#!/usr/bin/env bash
# The container's entrypoint is our launcher: the same rendering, CUDA pool sizing, stub environment and
# supervision as `make serve`, on the image's own tritonserver (KIMI_TRITONSERVER). Settings come from the
# environment (KIMI_DEVICE, KIMI_VISION_CHECKPOINT, KIMI_ENCODER_INSTANCES, KIMI_PREPROCESS_INSTANCES,
# KIMI_ADMIN_KEY, KIMI_MPS); extra arguments go to tritonserver.
set -euo pipefail
ckpt="${KIMI_VISION_CHECKPOINT:-/checkpoint}"
[[ -f "${ckpt}/config.json" ]] || ckpt=""  # nothing mounted: the embedded demo model
exec python3 -m backends.deploy.launcher --checkpoint "${ckpt}" --repository-dir /tmp/model_repository -- "$@"
