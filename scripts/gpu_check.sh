#!/usr/bin/env bash
# GPU acceptance in one command (~10 minutes on one H100):
#
#   scripts/gpu_check.sh [WHEEL_DIR] [OUT_DIR]
#
# 1. installs the project (pip --no-deps, no network) and, from WHEEL_DIR (filled by
#    scripts/fetch_gpu_wheels.sh), the wheels the GPU image lacks; a feature whose wheel is
#    absent is named and its tests skip;
# 2. env_check (GPUs, NCCL, P2P/IB, all-reduce bandwidth with >= 2 GPUs);
# 3. pytest -m gpu: every CUDA path against the fp32 reference (tests/integration/test_gpu.py);
# 4. the 1B throughput run (benchmarks/bench_gpu.py: bf16 + compile, with and without float8
#    tensorwise, seq 2048): tokens/s/GPU, MFU, peak memory vs the estimate, first/last loss,
#    and the peer row: a plain transformers LlamaForCausalLM loop on the same shape, 2 rounds
#    alternating with torchllm's variants, each variant's ratio torchllm / peer tokens/s.
# Everything lands in OUT_DIR (default outputs/gpu_check/<UTC date-time>): report.md (read
# this first), gpu_check.log, env_check.json, pytest_gpu.xml, gpu_<device>_<date>.{json,md}
# and logs.tar.gz. Exit code: 0 when every test and benchmark variant passed, else 1.
# Step time limits (seconds) can be changed: TEST_TIMEOUT (default 230), BENCH_TIMEOUT (480).
# BENCH_ARGS: extra arguments for benchmarks/bench_gpu.py (e.g. a CPU smoke run of this
# script: BENCH_ARGS="--device cpu --config train_configs/debug_model.toml --seq_len 32
# --variants fp32 --steps 1 --warmup 2 --peer_precision fp32"). INSTALL_PROJECT=0 skips `pip install -e .` (the
# repo is on PYTHONPATH either way), for machines whose environment others share.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHEEL_DIR=${1:-}
OUT_DIR=${2:-outputs/gpu_check/$(date -u +%Y-%m-%d_%H%M)}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=${WORK_DIR:-/tmp/torchllm_gpu_check}
SITE=$WORK/site
PY=${PYTHON:-python3}
mkdir -p "$WORK"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
START=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }
NOTES=()

say "installing (offline) into $SITE"
if [ -n "$WHEEL_DIR" ]; then
    if ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
        for whl in "$WHEEL_DIR"/*.whl; do  # one by one: a wheel that fails stops only itself
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$SITE" "$whl" || NOTES+=("could not install $(basename "$whl")")
        done
    else
        NOTES+=("$WHEEL_DIR holds no wheels")
    fi
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ "${INSTALL_PROJECT:-1}" = 1 ]; then
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
        || say "pip install -e . failed; using PYTHONPATH=$REPO instead"
fi
for pair in "torchao:float8 tests and the float8 throughput variant" \
            "torchdata:stateful data loaders" "datasets:Hugging Face datasets"; do
    mod=${pair%%:*}; what=${pair#*:}
    if "$PY" -c "import $mod" >/dev/null 2>&1; then
        say "$mod: $("$PY" -c "import $mod; print(getattr($mod, '__version__', 'present'))")"
    else
        NOTES+=("$mod is not installed (no wheel in ${WHEEL_DIR:-WHEEL_DIR}): $what will skip or fail")
        say "${NOTES[-1]}"
    fi
done
TOKENIZER=auto
[ -n "$WHEEL_DIR" ] && [ -f "$WHEEL_DIR/llama3/tokenizer.model" ] && TOKENIZER="$WHEEL_DIR/llama3/tokenizer.model"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU')"

say "env_check"
timeout 90 "$PY" -m torchllm.tools.env_check --json "$OUT_DIR/env_check.json"
ENV_RC=$?

say "pytest -m gpu"
timeout "${TEST_TIMEOUT:-230}" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest_gpu.xml" tests
TEST_RC=$?
[ $TEST_RC -eq 124 ] && NOTES+=("pytest -m gpu timed out after ${TEST_TIMEOUT:-230} s")

say "throughput: 1B, seq 2048, bf16 + compile, with and without float8 tensorwise, and the transformers peer"
timeout "${BENCH_TIMEOUT:-480}" "$PY" benchmarks/bench_gpu.py --out_dir "$OUT_DIR" \
    --work_dir "$WORK/bench" --tokenizer "$TOKENIZER" --timeout 140 --peer transformers \
    --rounds 2 ${BENCH_ARGS:-}
BENCH_RC=$?
[ $BENCH_RC -eq 124 ] && NOTES+=("the throughput run timed out after ${BENCH_TIMEOUT:-480} s")

find "$WORK/bench" -name 'log.txt' -print0 2>/dev/null | tar czf "$OUT_DIR/logs.tar.gz" --null -T - 2>/dev/null
{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ), $(( $(date +%s) - START )) s"
    echo
    "$PY" - "$OUT_DIR" <<'PYEOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
try:
    env = json.load(open(os.path.join(out, "env_check.json")))
    gpus = env.get("gpus") or [{"name": "none"}]
    print(f"- device: {env['gpu_count']} x {gpus[0]['name']}, torch {env['torch']}, "
          f"NCCL {env.get('nccl_version', '-')}")
except (OSError, ValueError, KeyError) as e:
    print(f"- env_check: no report ({e})")
try:
    root = ET.parse(os.path.join(out, "pytest_gpu.xml")).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    print(f"- pytest -m gpu: {n['tests']} tests, {n['failures']} failed, {n['errors']} errors, "
          f"{n['skipped']} skipped")
    for case in suite.iter("testcase"):
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""
                print(f"  - {tag}: {case.get('name')}: {msg}")
    # the teacher-forced oracle's measured worst per-step gaps (docs/gpu.md's tolerances)
    for case in suite.iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name", "").startswith("worst_gaps_"):
                print(f"  - gaps {case.get('name')} {prop.get('name')[11:]}: {prop.get('value')}")
except (OSError, ET.ParseError, AttributeError) as e:
    print(f"- pytest -m gpu: no report ({e})")
print()
for md in sorted(glob.glob(os.path.join(out, "gpu_*.md"))):
    print(open(md).read())
PYEOF
    for n in "${NOTES[@]}"; do echo "- note: $n"; done
    echo "- exit codes: env_check $ENV_RC, pytest $TEST_RC, bench $BENCH_RC"
} > "$OUT_DIR/report.md"
cat "$OUT_DIR/report.md"
say "report: $OUT_DIR/report.md"
# pytest exit 5 = no test selected (never expected here: treat as a failure too)
[ $TEST_RC -eq 0 ] && [ $BENCH_RC -eq 0 ] && [ $ENV_RC -eq 0 ]
