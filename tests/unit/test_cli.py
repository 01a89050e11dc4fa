"""The command line around the series tooling: serve-cpu's usage and help, the summary line, and the .pth hook."""
import subprocess
import sys

import pytest

from lmdeploy_guided_spec.cli import commands as cli
from lmdeploy_guided_spec.cpu import __main__ as cpu_main
from lmdeploy_guided_spec.cpu import hook

pytestmark = pytest.mark.tooling


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def test_serve_cpu_without_a_model_prints_its_usage(capsys: pytest.CaptureFixture):
    assert cli.main(['serve-cpu']) == 2
    err = capsys.readouterr().err
    assert err.startswith('usage: lmdeploy-guided-spec serve-cpu MODEL [lmdeploy serve api_server options]')
    assert 'MODEL is missing' in err and 'tiny-llama' in err
    assert 'error(s)' not in err
    assert cli.main(['serve-cpu', '--server-port', '23333']) == 2
    assert 'MODEL is missing' in capsys.readouterr().err


@pytest.mark.parametrize('command', [['-m', 'lmdeploy_guided_spec.cli', 'serve-cpu', '--help'],
                                     ['-m', 'lmdeploy_guided_spec.cpu', 'serve', '-h']])
def test_serve_help_prints_the_model_names_and_lmdeploys_options(command):
    result = _run(*command)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'unrecognized arguments' not in result.stderr
    assert 'MODEL [lmdeploy serve api_server options]' in result.stdout
    assert 'tiny-llama-eagle3' in result.stdout
    assert '--speculative-draft-model' in result.stdout and '--server-port' in result.stdout


def test_serve_refuses_to_start_without_the_hook_and_does_not_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture):
    def install(*args, **kwargs):
        raise AssertionError('serve-cpu installed the hook')

    monkeypatch.setattr(hook, 'is_installed', lambda site_dir=None: False)
    monkeypatch.setattr(hook, 'install', install)
    monkeypatch.setattr(cpu_main.models, 'resolve', lambda name: pytest.fail('resolved a model'))
    assert cli.main(['serve-cpu', 'tiny-llama', '--backend', 'pytorch']) == 2
    err = capsys.readouterr().err
    assert "the CPU path's hook is not installed" in err
    assert '-m lmdeploy_guided_spec.cpu install-hook' in err


def test_install_and_uninstall_hook_write_only_the_given_site(tmp_path):
    assert not hook.is_installed(tmp_path)
    path = hook.install(tmp_path)
    assert path == tmp_path / hook.PTH_NAME and hook.is_installed(tmp_path)
    assert hook.uninstall(tmp_path) and not path.exists()


def test_a_failed_check_without_errors_prints_no_summary(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture):
    from lmdeploy_guided_spec.cli import demo
    monkeypatch.setattr(demo, 'main', lambda args: 1)
    assert cli.main(['demo']) == 1
    assert 'error(s)' not in capsys.readouterr().err


def test_with_site_adds_the_site_to_every_command_that_takes_one():
    text = ('to fix: lmdeploy-guided-spec revert --force && lmdeploy-guided-spec apply; '
            'or: lmdeploy-guided-spec dev-export DIR; pip install --force-reinstall --no-deps lmdeploy==0.14.0')
    assert cli.with_site(text, None) == text
    assert cli.with_site(text, '/opt/my site') == (
        "to fix: lmdeploy-guided-spec revert --force --site '/opt/my site' && lmdeploy-guided-spec apply --site "
        "'/opt/my site'; or: lmdeploy-guided-spec dev-export DIR; pip install --force-reinstall --no-deps "
        'lmdeploy==0.14.0')


@pytest.mark.parametrize('command', [['status'], ['verify-series']])
def test_a_reader_that_goes_away_gets_no_traceback(command):
    """``lmdeploy-guided-spec status | head -1``: the reader closes the pipe before the command has written its
    output. The command stops writing and exits with 141 (as a process killed by SIGPIPE), with no traceback."""
    import os
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([sys.executable, '-m', 'lmdeploy_guided_spec.cli', *command], stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert 'Traceback' not in result.stderr and 'BrokenPipeError' not in result.stderr, result.stderr
    assert result.returncode == 141, result.stderr
