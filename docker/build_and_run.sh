#!/usr/bin/env bash
# `make image-test`: build docker/Dockerfile for real and check one answer of the container, from nothing:
#   1. podman, runc and debootstrap from apt where absent;
#   2. a Debian base image made here (debootstrap --variant=minbase, imported), once: no registry is needed;
#   3. the image on that base with KIMI_DEVICE=cpu (tritonserver from the nvidia-pytriton wheel), this host's
#      pip settings passed as build secrets (an index mirror, its CA bundle; never stored in the image);
#   4. the container on free loopback ports with the embedded demo model, `make run`'s request sent to it
#      (clients/demo.py --url), the answer checked against the one README.md states (tests/readme_answer.py);
#   5. the container stopped (it must drain and exit 0) and removed.
# Any failure ends it with one line starting "image-test: error:" (the container's or the build's log tail
# above it) and exit status 1. Root is needed (debootstrap, podman with runc): under another user it runs
# itself again with sudo.
#
# Settings (environment): IMAGE (the image's tag), BASE (the base's tag), SUITE (the Debian release),
# MIRROR (default: this host's apt mirror for Debian, else deb.debian.org), READY_TIMEOUT (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SELF=$ROOT/docker/build_and_run.sh
IMAGE=${IMAGE:-localhost/kimi-vision-triton:cpu}
SUITE=${SUITE:-bookworm}
BASE=${BASE:-localhost/debian-base:$SUITE}
READY_TIMEOUT=${READY_TIMEOUT:-600}
PY=${PY:-$ROOT/.venv/bin/python}
WORK=$ROOT/build/image-test
T0=$SECONDS

say() { printf 'image-test: %s\n' "$*"; }
fail() { printf 'image-test: error: %s\n' "$*" >&2; exit 1; }
elapsed() { printf '%dm%02ds' $(((SECONDS - T0) / 60)) $(((SECONDS - T0) % 60)); }

if [[ $EUID -ne 0 ]]; then
  command -v sudo > /dev/null || fail "needs root (debootstrap, podman with runc); no sudo here: run it as root"
  exec sudo --preserve-env=IMAGE,SUITE,BASE,MIRROR,READY_TIMEOUT,PY,PIP_INDEX_URL,PIP_EXTRA_INDEX_URL,PIP_FIND_LINKS,PIP_CERT \
    bash "$SELF" "$@"
fi
[[ -x $PY ]] || fail "$PY is missing: run \`make setup\` (make image-test does)"
# The expected answer: README.md's `make run` block, by tests/readme_answer.py's rule (the sum to
# float32 rounding; the checksum too where the sum is README's to the last digit).
"$PY" -c 'import pathlib, tests.readme_answer as r; r.readme_answer(pathlib.Path("README.md").read_text())' 2> /dev/null \
  || fail "README.md states no 'image embeds: ... sum S, sha256 H' line to check against"
mkdir -p "$WORK"

# 1. The tools, from apt where absent.
need=()
for tool in podman runc debootstrap; do command -v "$tool" > /dev/null || need+=("$tool"); done
[[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] || need+=(debian-archive-keyring)
if ((${#need[@]})); then
  command -v apt-get > /dev/null || fail "install ${need[*]} (no apt-get here)"
  say "installing ${need[*]} (apt-get)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"; } > "$WORK/apt.log" 2>&1 \
    || { tail -20 "$WORK/apt.log" >&2; fail "apt-get install ${need[*]} failed (log: build/image-test/apt.log)"; }
fi

# Podman's settings for this run only (the system's containers.conf is left alone): runc with cgroupfs, which
# work on cgroup v1, v2 and hybrid hosts alike (crun refuses hybrid ones), and no default ulimits (raising
# them fails where the host's are lower).
cat > "$WORK/containers.conf" << 'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
export CONTAINERS_CONF=$WORK/containers.conf

# 2. The Debian base, made once (kept as $BASE; `podman rmi $BASE` makes it again).
if podman image exists "$BASE"; then
  say "base $BASE: present"
else
  if [[ -z ${MIRROR:-} ]]; then  # this host's apt mirror for Debian (one-line or deb822 sources), if it has one
    MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2> /dev/null \
      | grep -v -E '^\s*#' | grep -o -E 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ') || true
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
  fi
  say "base $BASE: debootstrap --variant=minbase $SUITE from $MIRROR"
  rootfs=$(mktemp -d /var/tmp/kimi-debootstrap.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; fail "debootstrap $SUITE from $MIRROR failed (log: build/image-test/debootstrap.log)"; }
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" > "$WORK/import.log" 2>&1 \
    || { tail -5 "$WORK/import.log" >&2; fail "podman import of the debootstrap tree failed"; }
  rm -rf "$rootfs"; trap - EXIT
  say "base $BASE: made ($(elapsed))"
fi

# 3. The image. This host's pip settings, as build secrets: its index (and extra ones) over http(s), its CA
# bundle, its find-links folders (mounted read-only for the build); not its constraints or local file:// indexes.
secrets=(); mounts=()
"$PY" - "$WORK/pip.conf" > "$WORK/pip-mounts" << 'EOF' || fail "could not read this host's pip settings"
import os, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
settings = {}
for line in sorted(out.splitlines(), key=lambda l: l.startswith(":env:")):  # the environment's win
    key, _, value = line.partition("=")
    settings[key.split(".", 1)[-1]] = value.strip().strip("'\"")
conf, mounts = ["[global]"], []
for key in ("index-url", "extra-index-url", "trusted-host", "default-timeout", "timeout", "retries"):
    if key in settings:
        values = settings[key].split()
        if key.endswith("index-url"):
            values = [v for v in values if v.startswith(("http://", "https://"))]
        if values:
            conf.append(f"{key} = {' '.join(values)}")
links = [v for v in settings.get("find-links", "").split() if os.path.isdir(v)]
if links:
    conf.append(f"find-links = {' '.join(os.path.abspath(v) for v in links)}")
    mounts += [os.path.abspath(v) for v in links]
if os.path.isfile(settings.get("cert", "")):
    conf.append("cert = /run/secrets/pip-cert")
    print("cert", os.path.abspath(settings["cert"]))
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold an index's credentials
os.write(fd, ("\n".join(conf) + "\n").encode())
os.close(fd)
for m in mounts:
    print("mount", m)
EOF
secrets+=(--secret "id=pip.conf,src=$WORK/pip.conf")
while read -r kind path; do
  case $kind in
    cert) secrets+=(--secret "id=pip-cert,src=$path") ;;
    mount) mounts+=(--volume "$path:$path:ro") ;;
  esac
done < "$WORK/pip-mounts"
# torch's CPU build: from download.pytorch.org where this host reaches it, else from the pip settings alone.
torch_index=(--build-arg TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu)
if ! "$PY" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=15)" 2> /dev/null; then
  say "download.pytorch.org is out of reach: torch's CPU build must come from this host's pip settings"
  torch_index=(--build-arg TORCH_CPU_INDEX=)
fi
say "building $IMAGE on $BASE (KIMI_DEVICE=cpu; log: build/image-test/build.log)"
t=$SECONDS
if ! podman build --format docker -f docker/Dockerfile -t "$IMAGE" --build-arg "BASE_IMAGE=$BASE" \
    --build-arg KIMI_DEVICE=cpu "${torch_index[@]}" "${secrets[@]}" "${mounts[@]}" . > "$WORK/build.log" 2>&1; then
  rm -f "$WORK/pip.conf"; tail -30 "$WORK/build.log" >&2; fail "podman build failed (log: build/image-test/build.log)"
fi
rm -f "$WORK/pip.conf"
say "built $IMAGE in $((SECONDS - t)) s ($(podman image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}'))"

# 4. The container, on free loopback ports.
read -r http grpc metrics < <("$PY" -c "from backends.deploy.ports import free_ports; print(*free_ports(3))")
name=kimi-image-test-$$
logs() { podman logs "$name" 2>&1 | tail -"${1:-30}" >&2; }
cleanup() { podman rm -f -t 0 "$name" > /dev/null 2>> "$WORK/podman.log" || true; }
trap cleanup EXIT
# --health-interval=disable: no systemd timer for the image's HEALTHCHECK; it is run once by hand below.
# (podman 4.3 still logs, on a host without systemd, that it cannot add or remove that timer: such lines
# go to build/image-test/podman.log.)
podman run -d --name "$name" --shm-size=3g --health-interval=disable \
  -p "127.0.0.1:$http:8000" -p "127.0.0.1:$grpc:8001" -p "127.0.0.1:$metrics:8002" "$IMAGE" > /dev/null 2>> "$WORK/podman.log" \
  || { tail -5 "$WORK/podman.log" >&2; fail "podman run $IMAGE failed"; }
say "container $name started (HTTP $http, gRPC $grpc, metrics $metrics on 127.0.0.1); waiting for ready"
t=$SECONDS
until "$PY" -c "import urllib.request as u, sys; u.urlopen('http://127.0.0.1:$http/v2/health/ready', timeout=3)" 2> /dev/null; do
  if [[ $(podman container inspect -f '{{.State.Running}}' "$name") != true ]]; then
    logs; fail "the container exited (status $(podman container inspect -f '{{.State.ExitCode}}' "$name")) before it was ready"
  fi
  ((SECONDS - t < READY_TIMEOUT)) || { logs; fail "the container was not ready after $READY_TIMEOUT s"; }
  sleep 2
done
say "ready in $((SECONDS - t)) s"
podman healthcheck run "$name" > /dev/null || { logs; fail "the image's HEALTHCHECK does not pass on a ready server"; }
"$PY" -m clients.demo --url "127.0.0.1:$grpc" | tee "$WORK/answer.txt" || { logs; fail "the sample request failed"; }
"$PY" -m tests.readme_answer "$WORK/answer.txt" || fail "the container's answer is not make run's in README.md (rule: tests/readme_answer.py)"

# 5. Stop: the launcher drains and exits 0 on SIGTERM.
podman stop -t 40 "$name" > /dev/null 2>> "$WORK/podman.log" || fail "podman stop failed (log: build/image-test/podman.log)"
status=$(podman container inspect -f '{{.State.ExitCode}}' "$name")
[[ $status == 0 ]] || { logs; fail "the container exited with status $status on SIGTERM (expected 0)"; }
podman logs "$name" > "$WORK/container.log" 2>&1 || true
podman rm "$name" > /dev/null 2>> "$WORK/podman.log"; trap - EXIT
say "passed: the answer README.md states; the container stopped cleanly; $(elapsed) in all"
