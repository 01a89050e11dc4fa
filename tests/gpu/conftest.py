"""Fixtures of the GPU tests: the tiny models, and engine runs in worker processes, cached for the session.

Nothing here touches CUDA or imports lmdeploy at collection time, so ``pytest tests/gpu`` collects and skips
cleanly on a machine without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gpu_cases
import pytest

WORKER = Path(__file__).parent / 'engine_worker.py'
#: seconds one engine configuration may take: start, CUDA graph capture and every job
WORKER_TIMEOUT = 1500
#: a folder of engine runs a GPU session saved (its ``engine-runs*`` folder: ``<configuration>.out.json``): the
#: pipeline tests check those outputs instead of running engines, on any machine (GPU_ENGINE_RUNS_FROM)
SAVED_RUNS = os.environ.get('GPU_ENGINE_RUNS_FROM')
#: engine configurations run at once when the session starts (GPU_ENGINE_PARALLEL; 1: each when a test first asks)
ENGINE_PARALLEL = int(os.environ.get('GPU_ENGINE_PARALLEL', '1'))


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

    @staticmethod
    def key(method: str, *, spec: bool, eager: bool, force_triton: bool = False, workload: str = 'jobs') -> tuple:
        return (method, spec, eager, force_triton and spec, workload)

    def get(self, method: str, *, spec: bool, eager: bool, force_triton: bool = False, workload: str = 'jobs') -> dict:
        """The outputs of one engine configuration; ``workload`` names the requests and the cache
        (:data:`gpu_cases.WORKLOADS`)."""
        key = self.key(method, spec=spec, eager=eager, force_triton=force_triton, workload=workload)
        if key not in self._results:
            self._results[key] = self._run(*key)
        return self._results[key]

    def prefetch(self, keys: list[tuple], parallel: int) -> None:
        """Run the configurations ``keys`` ``parallel`` at a time (tiny models share one GPU well); a configuration
        that fails is left for :meth:`get` to run again and report."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._results]

        def one(key):
            try:
                self._results[key] = self._run(*key)
            except BaseException:  # pytest.fail raises outside Exception; get() reruns it and reports
                pass

        with ThreadPoolExecutor(max(1, parallel)) as pool:
            list(pool.map(one, todo))

    def _run(self, method: str, spec: bool, eager: bool, force_triton: bool, workload: str = 'jobs') -> dict:
        target, draft = gpu_cases.targets(self.models, method)
        name = f'{method}-{"spec" if spec else "nospec"}-{"eager" if eager else "graph"}' + (
            '-triton' if force_triton else '') + ('' if workload == 'jobs' else f'-{workload}')
        cfg = dict(model=str(target), method=method if spec else None, draft=str(draft) if spec else None,
                   eager=eager, force_triton=force_triton, workload=workload)
        if SAVED_RUNS:
            saved = Path(SAVED_RUNS) / f'{name}.out.json'
            if not saved.exists():
                pytest.skip(f'{saved} does not exist (GPU_ENGINE_RUNS_FROM)')
            return json.loads(saved.read_text())
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


def _engine_keys(items) -> list[tuple]:
    """The engine configurations the selected tests of test_pipeline_spec.py and test_full_kv_cache.py ask for (FA3
    ones included: a test without FA3 skips before it asks, and prefetch leaves those out)."""
    keys = []
    for item in items:
        params = getattr(getattr(item, 'callspec', None), 'params', {})
        if item.nodeid.startswith('tests/gpu/test_full_kv_cache.py'):
            keys += [EngineRuns.key('eagle3', spec=params['spec'], eager=False, force_triton=params['spec'],
                                    workload='preempt'),
                     EngineRuns.key('eagle3', spec=False, eager=False, workload='preempt-ref')]
            continue
        if not item.nodeid.startswith('tests/gpu/test_pipeline_spec.py'):
            continue
        method, eager = params.get('method'), params.get('eager')
        if item.originalname == 'test_free_drafts_follow_their_grammar_and_equal_non_speculative':
            keys += [EngineRuns.key(method, spec=True, eager=False, force_triton=True, workload='free-drafts'),
                     EngineRuns.key(method, spec=False, eager=False)]
            continue
        if item.originalname == 'test_cuda_graphs_and_eager_mode_agree':
            keys += [EngineRuns.key(method, spec=True, eager=e, force_triton=True) for e in (False, True)]
            continue
        if item.originalname in ('test_speculative_outputs_follow_their_grammar',
                                 'test_greedy_speculative_equals_non_speculative'):
            keys.append(EngineRuns.key(method, spec=True, eager=eager, force_triton=params['attention'] == 'triton'))
        if item.originalname in ('test_non_speculative_outputs_follow_their_grammar',
                                 'test_greedy_speculative_equals_non_speculative'):
            keys.append(EngineRuns.key(method, spec=False, eager=eager))
    return keys


@pytest.fixture(scope='session')
def engine_runs(request, tiny_models, tmp_path_factory) -> EngineRuns:
    runs = EngineRuns(tiny_models, tmp_path_factory.mktemp('engine-runs'))
    if ENGINE_PARALLEL > 1 and not SAVED_RUNS:
        keys = _engine_keys(request.session.items)
        from lmdeploy.pytorch.backends.cuda.attention import use_fa3
        if not use_fa3:
            # without FA3 the Triton kernel verifies every window: a key without force_triton is the same run
            keys = [k for k in keys if not k[1] or k[3]]
        runs.prefetch(keys, ENGINE_PARALLEL)
    return runs


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
        # the engine's stop tokens, as the engine builds it (a stop token inside a string is then a failure)
        self.manager = GuidedDecodingManager(AutoTokenizer.from_pretrained(str(model_dir)), cfg.vocab_size,
                                             cfg.eos_token_id)
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
