"""``lmdeploy-guided-spec demo`` with the tiny models, and the CPU path's hook.

The demo with SmolLM2, the README's main command, runs as an example of README.md (conftest.py).
"""
import subprocess
import sys

import pytest

from lmdeploy_guided_spec.cpu import hook


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, '-m', 'lmdeploy_guided_spec.tools.cli', *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize('model', ['tiny'])
def test_demo_with_tiny_models(cpu_path, model):
    result = _run('demo', '--model', model, '--compare')
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert 'valid JSON, valid for the schema' in out
    assert 'target forwards' in out and 'accepted draft tokens per step' in out
    assert 'token for token identical' in out


def test_the_hook_is_installed_and_inert_without_the_variable(cpu_path):
    assert hook.is_installed()
    probe = 'import sys, lmdeploy; from lmdeploy_guided_spec import cpu; print(cpu.active())'
    env_off = {k: v for k, v in __import__('os').environ.items() if k != 'LMDEPLOY_GUIDED_SPEC_DEVICE'}
    off = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, env=env_off, timeout=120)
    on = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True,
                        env={**env_off, 'LMDEPLOY_GUIDED_SPEC_DEVICE': 'cpu'}, timeout=120)
    assert off.stdout.split()[-1] == 'False' and on.stdout.split()[-1] == 'True', (off.stderr, on.stderr)
