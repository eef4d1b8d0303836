#!/usr/bin/env bash
# Render the repository for this device and checkpoint, then exec tritonserver with production flags.
set -euo pipefail
ckpt=""
[[ -f "${CHECKPOINT_DIR}/config.json" ]] && ckpt="${CHECKPOINT_DIR}"
python3 -m backends.deploy.repository --device "${DEVICE}" --checkpoint "${ckpt}" --out /tmp/model_repository
pool=()
[[ "${DEVICE}" == gpu ]] && pool=(--cuda-memory-pool-byte-size=0:$((2 << 30)))
exec tritonserver --model-repository=/tmp/model_repository --model-control-mode=none \
    --strict-readiness=true --exit-on-error=true --disable-auto-complete-config "${pool[@]}" "$@"
