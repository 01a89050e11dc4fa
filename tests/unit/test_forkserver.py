"""The fork server of the grammar compiler processes: a compiler process starts in a fraction of a fresh
interpreter's time, also after a kill; a fork server that dies takes its children with it and the next compile
starts another; its children are reaped, and their exit codes reach the serving process; a script without a main
guard is not run again."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmdeploy_guided_spec import GrammarCompilerUnavailable
from lmdeploy_guided_spec.compile import GrammarCompileService
from lmdeploy_guided_spec.forkserver import ForkedProcess, fork_server, supported
from lmdeploy_guided_spec.testing import tokenizer_info

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not supported(), reason='the fork server needs Linux pidfds')]

PRELOAD = 'lmdeploy_guided_spec.compile'
# a pattern xgrammar parses for about a minute: a compile that is running when the test acts
SLOW = {'type': 'string', 'pattern': '^[a-z]{1,40000}$'}


def _first_check_s(fork: bool) -> float:
    """Seconds from a checker's creation to its first answer: its first process's start, and one small check."""
    start = time.perf_counter()
    with GrammarCompileService(None, timeout_s=60, max_workers=1, fork=fork) as checker:
        assert checker.check('regex', '[0-9]+').result(timeout=120) is False
        assert isinstance(checker._children[0].process, ForkedProcess) == fork
    return time.perf_counter() - start


def _state(pid: int) -> str | None:
    """The state letter of ``pid`` ('Z': a zombie nobody reaped), None where it is gone."""
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while _state(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return _state(pid) is None


def test_a_forked_compiler_process_starts_in_a_fraction_of_a_fresh_ones_time():
    """A fresh interpreter imports xgrammar, torch and transformers (seconds, each time a process starts: after a
    kill at the limit too); a child of the fork server starts in milliseconds. Side by side in one run."""
    _first_check_s(fork=True)  # the fork server starts (once per process)
    forked = min(_first_check_s(fork=True) for _ in range(3))
    fresh = _first_check_s(fork=False)
    print(f'\n[fork server] a checker answers its first check after {forked:.2f} s forked, {fresh:.2f} s fresh '
          f'(x{fresh / forked:.1f})')
    assert forked * 4 < fresh, (forked, fresh)


def test_a_killed_child_is_reaped_and_its_exit_code_reaches_the_service():
    with GrammarCompileService(tokenizer_info('llama3'), timeout_s=120, max_workers=1) as service:
        service.compile('regex', 'warm-up[0-9]')
        future = service.submit('json_schema', SLOW)
        deadline = time.monotonic() + 30
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        child = service._children[0].process
        assert isinstance(child, ForkedProcess)
        assert child.poll() is None
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(GrammarCompilerUnavailable, match=r'died \(exit code -9\)'):
            future.result(timeout=30)
        assert child.wait(timeout=10) == -signal.SIGKILL and child.poll() == -signal.SIGKILL
        assert _gone(child.pid), f'the killed compiler process is left as {_state(child.pid)!r}'
        child.kill()  # reaped: a no-op, never a signal to a process that took its pid
        start = time.perf_counter()
        assert service.compile('regex', 'after[0-9]') is not None
        assert service._children[0].process is not child
        again = time.perf_counter() - start
        print(f'\n[fork server] a compile after the kill, its process started again: {again:.2f} s')


def test_a_fork_server_that_dies_takes_its_children_and_the_next_compile_starts_another():
    with GrammarCompileService(tokenizer_info('llama3'), timeout_s=120, max_workers=1) as service:
        service.compile('regex', 'warm-up[0-9]')
        server = fork_server(PRELOAD)
        future = service.submit('json_schema', SLOW)
        deadline = time.monotonic() + 30
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        child = service._children[0].process
        server.process.kill()
        with pytest.raises(GrammarCompilerUnavailable, match='died'):
            future.result(timeout=30)
        assert _gone(server.process.pid) and _gone(child.pid), 'the compiler process outlived its fork server'
        assert service.compile('regex', 'after[0-9]') is not None
        assert fork_server(PRELOAD) is not server and not fork_server(PRELOAD).dead


def test_a_stop_signal_to_the_process_group_leaves_the_fork_server_to_its_serving_process():
    """Ctrl-C (SIGINT) and a service stop (systemd, docker: SIGTERM) reach the whole process group of an api_server.
    The fork server died of SIGTERM while the server shut down gracefully, and the server started fresh
    interpreters to check the grammars of requests still in flight (seconds each, for an engine already gone). The
    fork server ends with the process it serves, not before it."""
    with GrammarCompileService(tokenizer_info('llama3'), timeout_s=120, max_workers=1) as service:
        service.compile('regex', 'warm-up[0-9]')
        server = fork_server(PRELOAD)
        for sig in (signal.SIGINT, signal.SIGTERM):
            server.process.send_signal(sig)
            time.sleep(0.5)
            assert server.process.poll() is None, f'the fork server died of {sig.name}'
        assert service.compile('regex', 'after-the-signals[0-9]') is not None
        assert fork_server(PRELOAD) is server and not server.dead


_SCRIPT = """
import sys
print('the script ran', flush=True)
from lmdeploy_guided_spec.compile import grammar_is_empty
print(grammar_is_empty('regex', '[0-9]+'), flush=True)
"""


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """multiprocessing's spawn and forkserver import the parent's ``__main__`` again in each child: a user's script
    without a main guard would run again there (and start a checker there, and so on)."""
    script = tmp_path / 'no_guard.py'
    script.write_text(textwrap.dedent(_SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ['the', 'script', 'ran', 'False'], out.stdout


def test_a_service_answers_while_its_fork_server_starts():
    """The fork server starts (seconds: it imports xgrammar) when a compiler process first starts, and again after it
    died. The service started its process under its lock, so submit(), lookup() and close() (an engine's step, the
    server's event loop) waited those seconds."""
    _first_check_s(fork=True)  # this process's fork server is up
    deadline = time.monotonic() + 10
    old = fork_server(PRELOAD)
    old.process.kill()
    while not old.dead and time.monotonic() < deadline:
        time.sleep(0.01)
    assert old.dead
    with GrammarCompileService(tokenizer_info('llama3'), timeout_s=120, max_workers=1) as service:
        slowest = 0.0
        while not (service._children[0] is not None and service._children[0].ready):
            start = time.perf_counter()
            assert service.lookup('regex', 'not-compiled[0-9]') is None
            slowest = max(slowest, time.perf_counter() - start)
            time.sleep(0.01)
        assert slowest < 0.5, slowest
        assert fork_server(PRELOAD) is not old
        assert service.compile('regex', 'then[0-9]') is not None


def test_a_service_serves_with_descriptors_numbered_past_1024():
    """A server with many connections hands out descriptors numbered past 1024, which ``select`` refuses: the pidfd
    of a compiler process was one, and every compile and check failed with a ValueError (an invalid-grammar error to
    the client), and the service could not close."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f'the descriptor limit is {hard}')
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    null = os.open(os.devnull, os.O_RDONLY)
    fillers = []
    try:
        while not fillers or fillers[-1] < 1030:
            fillers.append(os.dup(null))
        with GrammarCompileService(tokenizer_info('llama3'), timeout_s=120, max_workers=1) as service:
            assert service.compile('regex', 'high-fd[0-9]') is not None
            child = service._children[0].process
            assert child._pidfd >= 1024, child._pidfd
            future = service.submit('json_schema', SLOW)
            deadline = time.monotonic() + 30
            while not future.running() and time.monotonic() < deadline:
                time.sleep(0.01)
            child.kill()
            with pytest.raises(GrammarCompilerUnavailable, match='died'):
                future.result(timeout=30)
            assert service.compile('regex', 'high-fd-again[0-9]') is not None
    finally:
        for fd in fillers:
            os.close(fd)
        os.close(null)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_fork_of_the_serving_process_leaves_its_compiler_processes_alone():
    """A process manager's worker forked from a serving process inherits its services (and the checker's close at
    exit) and the pidfds of their processes: closing them there killed the parent's compiler processes, and waited
    for exit reports that only the parent's thread reads."""
    with GrammarCompileService(tokenizer_info('llama3'), timeout_s=120, max_workers=1) as service:
        assert service.compile('regex', 'before-fork[0-9]') is not None
        child = service._children[0].process
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child reports by its exit code)
            code = 1
            try:
                start = time.monotonic()
                service.close()
                code = 0 if time.monotonic() - start < 5 else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail('the fork did not end within 60 s')
            time.sleep(0.05)
        status = ended[1]
        assert os.waitstatus_to_exitcode(status) == 0
        assert child.poll() is None and _state(child.pid) not in (None, 'Z')
        assert service.compile('regex', 'after-fork[0-9]') is not None
        assert service._children[0].process is child
