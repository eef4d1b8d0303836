#!/usr/bin/env bash
# The stage table (bench/stage_bench.py through tools/gpu_session.sh) with this tree and with some files
# as they were at an earlier commit, in one GPU call: after, before, after again (a machine's speed moves
# between calls more than within one).
#   bash tools/stages_ab.sh prepare <commit> <file>...  # here: the files at <commit> under .whl/before/
#                                                       # (carried to the GPU machine with .whl)
#   bash tools/stages_ab.sh run                         # there: $OUT/stage_after1.md, stage_before.md,
#                                                       # stage_after2.md (STAGES_TIMEOUT s each, default 140)
set -uo pipefail
before=.whl/before
case "${1:-}" in
  prepare)
    commit=${2:?a commit}; shift 2
    rm -rf "$before" && mkdir -p "$before"
    for f in "$@"; do
      mkdir -p "$before/$(dirname "$f")" && git show "$commit:$f" > "$before/$f" || exit 1
    done
    (cd "$before" && find . -type f | sort) > "$before.files" && mv "$before.files" "$before/FILES" ;;
  run)
    [[ -f $before/FILES ]] || { echo "nothing prepared: bash tools/stages_ab.sh prepare <commit> <file>..."; exit 2; }
    saved=$(mktemp -d)
    files=$(grep -v '^./FILES$' "$before/FILES")
    for f in $files; do mkdir -p "$saved/$(dirname "$f")"; cp "$f" "$saved/$f"; done
    one() {
      timeout "${STAGES_TIMEOUT:-140}" bash tools/gpu_session.sh stages > "/tmp/stages_$1.log" 2>&1
      cp /tmp/results/stage_bench.md "${OUT:-/tmp}/stage_$1.md" || tail -20 "/tmp/stages_$1.log"
    }
    one after1
    for f in $files; do cp "$before/$f" "$f"; done
    one before
    for f in $files; do cp "$saved/$f" "$f"; done
    one after2
    rm -rf "$saved" ;;
  *) echo "usage: bash tools/stages_ab.sh prepare <commit> <file>... | run"; exit 2 ;;
esac
