#!/usr/bin/env bash
# Fill WHEEL_DIR (default .whl, git-ignored) with what the offline GPU image lacks, for
# scripts/gpu_check.sh: torchao (float8; 0.17 is the release built for torch 2.11), torchdata
# (stateful loaders), datasets (+ dill, multiprocess: its needs the image lacks), all for the
# image's Python 3.12 on x86-64 Linux, plus the Llama 3 tokenizer from ../shared when present.
#
#   scripts/fetch_gpu_wheels.sh [WHEEL_DIR]          (run on a machine with network access)
#
# Versions can be changed with TORCHAO=, TORCHDATA=, DATASETS=, DILL=, MULTIPROCESS=.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_DIR=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$WHEEL_DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in "torchao==${TORCHAO:-0.17.0}" "torchdata==${TORCHDATA:-0.11.0}" \
            "datasets==${DATASETS:-5.2.0}" "dill==${DILL:-0.4.1}" \
            "multiprocess==${MULTIPROCESS:-0.70.19}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d "$WHEEL_DIR" "$spec"
done
TOKENIZER=../shared/tokenizers/llama3/tokenizer.model
if [ -f "$TOKENIZER" ]; then
    mkdir -p "$WHEEL_DIR/llama3" && cp "$TOKENIZER" "$WHEEL_DIR/llama3/tokenizer.model"
fi
ls -la "$WHEEL_DIR"
du -sh "$WHEEL_DIR"
echo "now run on the GPU machine: scripts/gpu_check.sh $WHEEL_DIR [OUT_DIR]"
