#!/bin/sh
# `make gpu-check` on a GPU machine that has Python and a CUDA build of torch but no network and
# none of our other dependencies: installs the bundle `make gpu-bundle` made (.gpu-bundle:
# wheels, and nanoGPT's files when it was given a checkout) into .gpu-bundle/site, runs
# bench/gpu_check.py with the machine's own torch, and leaves its JSON, its log and the
# bundle's install log in $OUT (default: gpu-check-out), also as one gpu_check.tgz.
#   sh tools/gpu_device_check.sh [gpu_check.py arguments, e.g. --loss-steps 1000]
set -eu
PYTHON=${PYTHON:-python3}
BUNDLE=${BUNDLE:-.gpu-bundle}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
"$PYTHON" tools/gpu_bundle.py install --bundle "$BUNDLE" --target "$BUNDLE/site" > "$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
if [ -d "$BUNDLE/nanogpt" ]; then NANOGPT=${NANOGPT:-$BUNDLE/nanogpt}; fi
export NANOGPT=${NANOGPT:-}
export PYTHONPATH="$BUNDLE/site:.${PYTHONPATH:+:$PYTHONPATH}"
{ "$PYTHON" bench/gpu_check.py --json "$OUT/gpu_check.json" "$@" 2>&1; echo $? > "$OUT/exit_code"; } \
    | tee "$OUT/gpu_check.log"
tar czf "$OUT/gpu_check.tgz" -C "$OUT" gpu_check.json gpu_check.log install.log 2>/dev/null || true
exit "$(cat "$OUT/exit_code")"
