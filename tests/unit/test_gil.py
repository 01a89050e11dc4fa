"""The grammar worker and the engine's GIL: the switch interval option, and benchmarks/gil_share.py runs."""
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmdeploy_guided_spec import GrammarWorker
from lmdeploy_guided_spec.worker import SWITCH_INTERVAL_ENV, switch_interval_from_env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def interval():
    """The process's switch interval, restored after the test."""
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


@pytest.mark.parametrize('value, seconds', [(None, None), ('', None), ('0.2', 0.0002), (' 1 ', 0.001)])
def test_the_variable_reads_as_milliseconds(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    else:
        monkeypatch.setenv(SWITCH_INTERVAL_ENV, value)
    assert switch_interval_from_env() == seconds


@pytest.mark.parametrize('value', ['0', '-1', 'fast', 'inf', 'nan'])
def test_a_bad_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, value)
    with pytest.raises(ValueError, match=SWITCH_INTERVAL_ENV):
        switch_interval_from_env()


def test_the_worker_thread_sets_the_interval_when_it_starts(monkeypatch, interval, caplog):
    sys.setswitchinterval(0.005)
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, '0.25')
    worker = GrammarWorker(inline=True)
    worker.run(lambda: None)
    assert sys.getswitchinterval() == 0.005, 'an inline worker starts no thread and leaves the interpreter alone'
    worker = GrammarWorker()
    with caplog.at_level(logging.INFO, logger='lmdeploy_guided_spec'):
        worker.run(lambda: None)
    worker.shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.00025)
    assert SWITCH_INTERVAL_ENV in caplog.text
    # a bad value: logged, and the interval stays
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, 'fast')
    worker = GrammarWorker()
    with caplog.at_level(logging.WARNING, logger='lmdeploy_guided_spec'):
        worker.run(lambda: None)
    worker.shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.00025)
    assert 'is not a positive number of milliseconds' in caplog.text
    # once per process: the next worker (another engine, rank or pipeline) does not log it again
    caplog.clear()
    worker = GrammarWorker()
    with caplog.at_level(logging.WARNING, logger='lmdeploy_guided_spec'):
        worker.run(lambda: None)
    worker.shutdown()
    assert 'is not a positive number' not in caplog.text
    # unset: Python's interval is left as it is
    monkeypatch.delenv(SWITCH_INTERVAL_ENV)
    sys.setswitchinterval(0.005)
    worker = GrammarWorker()
    worker.run(lambda: None)
    worker.shutdown()
    assert sys.getswitchinterval() == 0.005


def test_gil_share_prints_a_table_and_its_last_line():
    out = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'gil_share.py'), '--batches', '2',
                          '--reps', '1'], capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()
    rows = [line.split() for line in out if line.startswith(('default', 'free'))]
    assert [row[:2] for row in rows] == [['default', '2'], ['free', '2']], out
    assert out[-1] == 'worker_slowdown_beside_python_b128 n/a (batch 128 not run)', out


#: Grammar work submitted while the interpreter exits, as the engine loop of a pipeline nobody closed does (a daemon
#: thread): from a hook of ``threading`` that runs after ``concurrent.futures`` stopped its pools' threads.
_SUBMIT_AT_EXIT = '''
import threading


def step():
    print('committed', worker.run(lambda: 2), flush=True)


# registered before concurrent.futures registers its own hook: they run in reverse order, this one after it
threading._register_atexit(step)

from lmdeploy_guided_spec import GrammarWorker

worker = GrammarWorker()
assert worker.run(lambda: 1) == 1
'''


def test_grammar_work_submitted_while_the_interpreter_exits_runs():
    """Defect: an engine whose pipeline was not closed still steps while the interpreter exits; concurrent.futures
    stopped the worker's pool first, and the engine loop failed with "cannot schedule new futures after shutdown"
    (the example of docs/*/cpu.md, one run in two)."""
    run = subprocess.run([sys.executable, '-c', _SUBMIT_AT_EXIT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and 'committed 2' in run.stdout, (run.stdout, run.stderr)
    assert 'Traceback' not in run.stderr, run.stderr


def test_work_submitted_as_the_interpreter_begins_to_exit_waits_for_the_thread():
    """Between concurrent.futures' exit flag and the end of its thread, the thread may still run a job submitted
    before (a commit): the job submitted now runs on the caller's thread after it, not beside it."""
    import concurrent.futures.thread as pool_module
    worker, order = GrammarWorker(), []
    started = threading.Event()

    def first():
        started.set()
        time.sleep(0.5)
        order.append('first')

    worker.submit(first)
    started.wait(10)
    pool_module._shutdown = True  # what _python_exit sets before it stops the threads
    try:
        assert worker.submit(order.append, 'second').result(timeout=10) is None
    finally:
        pool_module._shutdown = False
    assert order == ['first', 'second']
    worker.shutdown()


def test_a_pool_that_fails_for_another_reason_is_not_taken_for_an_exit(monkeypatch):
    """A RuntimeError of the pool while the interpreter runs on (no thread can start: a limit of processes) is
    raised, not taken for an exit that would move the grammar work onto the engine's thread for good."""
    worker = GrammarWorker()
    worker.run(lambda: None)

    def refuse(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(worker._pool, 'submit', refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        worker.submit(lambda: None)
    monkeypatch.undo()
    assert worker.run(lambda: 3) == 3
    worker.shutdown()
