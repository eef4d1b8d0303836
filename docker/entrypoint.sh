#!/usr/bin/env bash
# The container's entrypoint is our launcher: the same rendering, CUDA pool sizing and stub environment
# as `make serve`, on the image's own tritonserver. Extra arguments go to tritonserver.
set -euo pipefail
ckpt=""
[[ -f "${KIMI_VISION_CHECKPOINT:-/checkpoint}/config.json" ]] && ckpt="${KIMI_VISION_CHECKPOINT:-/checkpoint}"
exec python3 -m backends.deploy.launcher --tritonserver /opt/tritonserver/bin/tritonserver \
    --device "${KIMI_DEVICE:-gpu}" --checkpoint "${ckpt}" --repository-dir /tmp/model_repository -- "$@"
