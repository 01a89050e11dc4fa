"""``lmdeploy-guided-spec demo`` with the tiny models, and the CPU path's hook.

The demo with SmolLM2, the README's main command, runs as an example of README.md (conftest.py).
"""
import subprocess
import sys

import pytest

from lmdeploy_guided_spec.cpu import hook


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, '-m', 'lmdeploy_guided_spec.cli', *args], capture_output=True,
                          text=True, timeout=timeout)


def test_demo_with_tiny_models(cpu_path):
    """Two methods of the table (one engine each; the whole table with SmolLM2 runs as the README's example)."""
    result = _run('demo', '--model', 'tiny', '--method', 'grammar,fsm')
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert 'did not start' not in result.stderr, result.stderr[-3000:]
    header = next(line for line in out.splitlines() if line.startswith('method '))
    assert header.split()[:8] == ['method', 'tokens', 'forwards', 'tokens/forward', 'drafted', 'forced', 'accepted',
                                  'time'], header
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (['grammar'], ['fsm'])
            and len(line.split()) > 8 and line.split()[1].isdigit()}
    assert set(rows) == {'grammar', 'fsm'}, out[-3000:]
    for name, row in rows.items():
        tokens, forwards, per_forward, drafted, forced, accepted = row[1:7]
        assert float(per_forward) == pytest.approx(int(tokens) / int(forwards), abs=0.01), row
        assert 0 < int(forced) <= int(drafted) and int(accepted) <= int(drafted), row
        assert int(forwards) < int(tokens), f'{name}: forced drafts are accepted, so a forward commits several tokens'
    assert 'valid JSON, valid for the schema' in out
    assert "a path of the FSM: 'Answer: " in out
    assert 'all outputs valid' in out


def test_demo_refuses_an_unknown_method():
    result = _run('demo', '--model', 'tiny', '--method', 'eagle', timeout=120)
    assert result.returncode == 2 and 'choose among none, eagle3, grammar, fsm' in result.stderr, result.stderr


def test_the_hook_is_installed_and_inert_without_the_variable(cpu_path):
    assert hook.is_installed()
    probe = 'import sys, lmdeploy; from lmdeploy_guided_spec import cpu; print(cpu.active())'
    env_off = {k: v for k, v in __import__('os').environ.items() if k != 'LMDEPLOY_GUIDED_SPEC_DEVICE'}
    off = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, env=env_off, timeout=120)
    on = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True,
                        env={**env_off, 'LMDEPLOY_GUIDED_SPEC_DEVICE': 'cpu'}, timeout=120)
    assert off.stdout.split()[-1] == 'False' and on.stdout.split()[-1] == 'True', (off.stderr, on.stderr)
