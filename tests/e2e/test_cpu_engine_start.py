"""The CPU path's engine start: its defaults, its memory error, and the api_server's engine process under load."""
import os
import subprocess
import sys

import pytest

from lmdeploy_guided_spec.cpu import engine


class _ManagerGone:
    """A manager condition whose manager shut down before it answered the engine process's last release."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.calls.append('acquire')
        return True

    def __exit__(self, *exc_info):
        self.calls.append('release')
        raise EOFError

    def notify(self, n=1):
        self.calls.append('notify')


def test_the_engine_process_survives_a_lost_reply_to_its_last_release():
    condition = _ManagerGone()
    shared = {}
    with engine._PortCondition(condition):
        shared['rpc_server_port'] = 1234
        engine._PortCondition(condition).notify()
    assert condition.calls == ['acquire', 'notify', 'release'] and shared == {'rpc_server_port': 1234}
    with pytest.raises(ValueError), engine._PortCondition(condition):
        raise ValueError('an error inside the block is not swallowed')


def test_the_engine_process_is_ours_and_pickles_by_reference(cpu_path):
    import pickle

    from lmdeploy.pytorch.engine.mp_engine import zmq_engine
    target = zmq_engine.ZMQMPEngine._mp_proc
    assert target is engine._engine_process
    assert pickle.loads(pickle.dumps(target)) is target


def test_default_max_batch_size(cpu_path):
    from lmdeploy import utils
    from lmdeploy.pytorch.engine import config_builder
    assert utils.get_max_batch_size('cuda') == engine.DEFAULT_MAX_BATCH_SIZE
    assert config_builder.get_max_batch_size('cuda') == engine.DEFAULT_MAX_BATCH_SIZE


def test_an_engine_that_does_not_fit_names_the_variable_and_options(cpu_path):
    code = ('from lmdeploy_guided_spec import cpu; from lmdeploy_guided_spec.cpu import models; cpu.activate(); '
            'from lmdeploy import pipeline; pipeline(models.resolve("tiny-llama"))')
    env = {**os.environ, engine.MEMORY_ENV: '0.005'}
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('RuntimeError: No enough gpu memory'), result.stderr[-3000:]
    assert f'{engine.MEMORY_ENV}=0.005 GiB' in last and '--max-batch-size' in last and 'max_batch_size' in last
