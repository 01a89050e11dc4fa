"""testing.kill_at_exit: a test run stopped by SIGTERM, or one that exits, leaves no server process group or session
running."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.unit

# a process that starts a session (a leader and its child, as a server and its engine process, and a child in a process
# group of its own, as lmdeploy's dp launcher starts each dp rank's server), hands it to kill_at_exit, prints the three
# pids, and then waits or exits as its argument says
SCRIPT = r'''
import subprocess, sys, time
from lmdeploy_guided_spec.testing import kill_at_exit
group = subprocess.Popen(['bash', '-c', 'sleep 300 & echo $!; set -m; sleep 300 & echo $!; wait'],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
kill_at_exit(group)
print(group.pid, group.stdout.readline().strip(), group.stdout.readline().strip(), flush=True)
if sys.argv[1] != 'exit':
    time.sleep(300)
'''


def _gone(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().split(') ')[1].startswith('Z')  # a zombie is gone, its parent has not reaped it yet
    except FileNotFoundError:
        return True


def _wait_gone(pids, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(sys.platform != 'linux', reason='reads /proc')
@pytest.mark.parametrize('how', ['sigterm', 'exit'])
def test_a_process_group_ends_with_the_process_that_started_it(how):
    proc = subprocess.Popen([sys.executable, '-c', SCRIPT, how], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(pids) == 3
        assert os.getpgid(pids[2]) == pids[2] != pids[0] and os.getsid(pids[2]) == pids[0]
        if how == 'sigterm':
            assert not any(_gone(pid) for pid in pids)
            os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=30)
        # SIGTERM still ends the process as SIGTERM does
        assert code == {'sigterm': -signal.SIGTERM, 'exit': 0}[how]
        assert _wait_gone(pids), pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# a process whose child is a multiprocessing one (as lmdeploy's multiprocess executor starts its rank processes, in
# the process group of their parent): it asks for its children to end with it, prints the child's pid and waits
CHILDREN_SCRIPT = r'''
import multiprocessing, time
from lmdeploy_guided_spec.testing import kill_children_at_exit
if __name__ == '__main__':
    child = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(300, ))
    child.start()
    kill_children_at_exit()
    print(child.pid, flush=True)
    time.sleep(300)
'''


@pytest.mark.skipif(sys.platform != 'linux', reason='reads /proc')
def test_multiprocessing_children_end_with_the_process_that_got_sigterm(tmp_path):
    """A test run stopped by SIGTERM while a pipeline with several ranks was up left a rank process running (its
    parent gone) for 44 minutes."""
    script = tmp_path / 'children.py'
    script.write_text(CHILDREN_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        assert not _gone(child)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert _wait_gone([child]), child
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)
