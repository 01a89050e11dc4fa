"""End-to-end tests: lmdeploy's own engine (patched by the series) on the CPU path, driven as a user drives it.

``pipeline(model, backend_config=PytorchEngineConfig(...), speculative_config=SpeculativeConfig(...))`` and
``lmdeploy serve api_server`` run unchanged; :mod:`lmdeploy_guided_spec.cpu` maps lmdeploy's CUDA device onto the
CPU. The models are the steered tiny models of :mod:`lmdeploy_guided_spec.cpu.models` (random weights: outputs and
acceptance rates mean nothing; the checks are that output is valid for its grammar and that speculative output
equals non-speculative output).

The CPU path patches torch and lmdeploy for the rest of the process, so the e2e tests run after every other test
of the session, and the path is activated by the first e2e fixture, not at collection. Only the Triton interpreter
is switched on here, because Triton reads that switch when it is imported.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lmdeploy_guided_spec.support.harness import enable_cpu_triton

enable_cpu_triton()

_HERE = Path(__file__).parent


#: where the checks with several ranks run among the e2e tests: ``first``, ``last``, or (unset) in file order.
#: scripts/test.sh runs them first against one release and last against the other, so that the two runs beside
#: each other never run them at the same time: two rank processes each on a two-core machine that runs the other
#: release's tests too took 2.5 to 3 times as long as alone, and memory peaked when both ran them at once
RANK_TESTS_ENV = 'GUIDED_SPEC_RANK_TESTS'
RANK_TESTS = _HERE / 'test_ranks.py'


def pytest_collection_modifyitems(config, items):
    e2e = [item for item in items if _HERE in Path(str(item.fspath)).parents]
    for item in e2e:
        item.add_marker(pytest.mark.e2e)
    others = [item for item in items if item not in set(e2e)]
    where = os.environ.get(RANK_TESTS_ENV, '')
    if where not in ('', 'first', 'last'):
        raise pytest.UsageError(f'{RANK_TESTS_ENV}={where!r}: first, last, or unset')
    if where:
        rank_tests = [item for item in e2e if Path(str(item.fspath)) == RANK_TESTS]
        rest = [item for item in e2e if Path(str(item.fspath)) != RANK_TESTS]
        e2e = rank_tests + rest if where == 'first' else rest + rank_tests
    items[:] = others + e2e


@pytest.fixture(scope='session')
def cpu_path():
    """The CPU path, active for the rest of the session."""
    from e2e_helpers import serialize_forwards

    from lmdeploy_guided_spec import cpu
    from lmdeploy_guided_spec.cpu import hook
    from lmdeploy_guided_spec.testing import kill_children_at_exit
    if not hook.is_installed():
        # lmdeploy's engine and rank processes reach the CPU path through the hook; the tests do not install it
        pytest.fail(f"the CPU path's hook is not installed ({hook.pth_path()}); to fix: {sys.executable} -m "
                    'lmdeploy_guided_spec.cpu install-hook (scripts/setup.sh runs it)')
    cpu.activate()
    # several engines live in this process: see serialize_forwards
    serialize_forwards()
    # the rank processes of pipelines with several ranks end with a test run stopped by SIGTERM
    kill_children_at_exit()
    return cpu


@pytest.fixture(scope='session')
def engines(cpu_path):
    """``engines(target, spec=True)``: a pipeline of a named model, speculative or not, built once per session."""
    from e2e_helpers import Engines
    pool = Engines()
    yield pool
    pool.close()


@pytest.fixture(scope='module')
def no_session_pipelines(engines):
    """Close the session's pipelines before a module that runs api_servers: each holds its engine and a grammar
    compiler process (about 0.5 GB together, 33 of them by then), and with the servers' processes beside them the
    test process outgrew the CI machine's 24 GB (the kernel killed pytest). Later modules build what they use again."""
    engines.close()
    yield
