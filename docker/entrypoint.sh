#!/usr/bin/env bash
# The container's entrypoint is our launcher: the same rendering, CUDA pool sizing, stub environment and
# supervision as `make serve`, on the image's own tritonserver (KIMI_TRITONSERVER). Settings come from the
# environment (KIMI_DEVICE, KIMI_VISION_CHECKPOINT, KIMI_ENCODER_INSTANCES, KIMI_PREPROCESS_INSTANCES,
# KIMI_ADMIN_KEY, KIMI_MPS); extra arguments go to tritonserver.
set -euo pipefail
# KIMI_TRITONSERVER, when set, is taken as it is (empty: the embedded server of the nvidia-pytriton wheel);
# unset, the base image's /opt/tritonserver (NGC's) where there is one, else the embedded server.
if [[ -z "${KIMI_TRITONSERVER+set}" && -x /opt/tritonserver/bin/tritonserver ]]; then
  export KIMI_TRITONSERVER=/opt/tritonserver/bin/tritonserver
fi
# KIMI_VISION_CHECKPOINT, when set, is taken as it is (a wrong path stops the launcher with one line);
# unset, the mount at /checkpoint if it holds a checkpoint, else the embedded demo model.
ckpt="${KIMI_VISION_CHECKPOINT-}"
if [[ -z "${KIMI_VISION_CHECKPOINT+set}" ]]; then
  ckpt=/checkpoint
  [[ -f "${ckpt}/config.json" ]] || ckpt=""
fi
exec python3 -m backends.deploy.launcher --checkpoint "${ckpt}" --repository-dir /tmp/model_repository -- "$@"
