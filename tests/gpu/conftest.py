"""Fixtures of the GPU tests: the tiny models, and engine runs in worker processes, cached for the session.

Nothing here touches CUDA or imports lmdeploy at collection time, so ``pytest tests/gpu`` collects and skips
cleanly on a machine without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_cases
import pytest

WORKER = Path(__file__).parent / 'engine_worker.py'
#: seconds one engine configuration may take: start, CUDA graph capture and every job
WORKER_TIMEOUT = 1500


@pytest.fixture(scope='session', autouse=True)
def _compiled_triton():
    """The GPU tests need Triton's compiler: refuse to run under the interpreter the CPU tests switch on."""
    if os.environ.get('TRITON_INTERPRET', '0') not in ('', '0'):
        pytest.fail('TRITON_INTERPRET is set (tests/engine/conftest.py sets it when the CPU tests are collected); '
                    'run the GPU tests on their own: pytest -m gpu tests/gpu')


@pytest.fixture(scope='session')
def tiny_models() -> dict[str, Path]:
    from lmdeploy_guided_spec.support import tiny_models as tm
    return dict(llama=tm.build_llama_target(), eagle3=tm.build_eagle3_draft(), deepseek=tm.build_deepseek_mtp_target())


class EngineRuns:
    """Runs :mod:`engine_worker` once per engine configuration and keeps the results for the session."""

    def __init__(self, models: dict[str, Path], workdir: Path):
        self.models = models
        self.workdir = workdir
        self._results: dict[tuple, dict] = {}

    def get(self, method: str, *, spec: bool, eager: bool, force_triton: bool = False) -> dict:
        key = (method, spec, eager, force_triton and spec)
        if key not in self._results:
            self._results[key] = self._run(*key)
        return self._results[key]

    def _run(self, method: str, spec: bool, eager: bool, force_triton: bool) -> dict:
        target, draft = gpu_cases.targets(self.models, method)
        name = f'{method}-{"spec" if spec else "nospec"}-{"eager" if eager else "graph"}' + (
            '-triton' if force_triton else '')
        cfg = dict(model=str(target), method=method if spec else None, draft=str(draft) if spec else None,
                   eager=eager, force_triton=force_triton)
        cfg_path = self.workdir / f'{name}.json'
        out_path = self.workdir / f'{name}.out.json'
        log_path = self.workdir / f'{name}.log'
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ)
        env.pop('LMDEPLOY_GUIDED_SPEC_FORCE_TRITON_SPEC', None)
        env.pop('TRITON_INTERPRET', None)
        with log_path.open('w') as log:
            try:
                proc = subprocess.run([sys.executable, str(WORKER), str(cfg_path), str(out_path)], stdout=log,
                                      stderr=subprocess.STDOUT, env=env, timeout=WORKER_TIMEOUT)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = 'timeout'
        if code != 0:
            tail = log_path.read_text()[-6000:]
            pytest.fail(f'engine worker {name} failed ({code}); log {log_path}:\n{tail}')
        return json.loads(out_path.read_text())


@pytest.fixture(scope='session')
def engine_runs(tiny_models, tmp_path_factory) -> EngineRuns:
    return EngineRuns(tiny_models, tmp_path_factory.mktemp('engine-runs'))


@pytest.fixture(scope='session')
def fa3_installed() -> bool:
    from lmdeploy.pytorch.backends.cuda.attention import use_fa3
    return bool(use_fa3)


class GrammarChecker:
    """Checks outputs against grammars compiled by lmdeploy's own GuidedDecodingManager for a model."""

    def __init__(self, model_dir: Path):
        from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
        from transformers import AutoConfig, AutoTokenizer
        cfg = AutoConfig.from_pretrained(str(model_dir))
        self.manager = GuidedDecodingManager(AutoTokenizer.from_pretrained(str(model_dir)), cfg.vocab_size)
        # the manager keeps its matchers in a class attribute shared with any engine in this process
        self.manager.processors = {}
        eos = cfg.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos])
        self._session = 0

    def check(self, kind: str, output: dict) -> None:
        self._session += 1
        gpu_cases.check_guided_output(self.manager, self._session, kind, output['token_ids'], output['text'],
                                      output['finish_reason'], self.eos_token_ids)


@pytest.fixture(scope='session')
def grammar_checkers(tiny_models):
    cache: dict[str, GrammarChecker] = {}

    def get(method: str) -> GrammarChecker:
        if method not in cache:
            cache[method] = GrammarChecker(gpu_cases.targets(tiny_models, method)[0])
        return cache[method]

    return get
