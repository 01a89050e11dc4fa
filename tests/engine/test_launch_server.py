"""The address lmdeploy's launcher of data-parallel api_servers (``launch_server``, ``--dp`` > 1) binds them to
(patch 0053 of 0.18.0, 0066 of 0.14.0): the ``--server-name`` asked for; for the default wildcard, the host ip as
before, or the wildcard itself on a node with no route to tell the host ip by (``tests/e2e/test_ranks.py``
``test_dp2_api_server`` serves on 127.0.0.1 through two dp ranks)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_the_servers_bind_to_the_address_asked_for():
    from lmdeploy.serve.openai.launch_server import get_host_ip, get_server_name
    for name in ('127.0.0.1', '10.1.2.3', 'localhost', '::1'):
        assert get_server_name(name) == name
    # the wildcard and no name: the host ip, which a proxy on another node can reach (lmdeploy's choice)
    try:
        host = get_host_ip()
    except OSError:
        pytest.skip('this machine has no route to tell its host ip by')
    assert get_server_name('0.0.0.0') == host
    assert get_server_name(None) == host


_OFFLINE = """
from lmdeploy.serve.openai import launch_server
try:
    launch_server.get_host_ip()
except OSError as e:
    print('host ip:', e)
print('server name:', launch_server.get_server_name('0.0.0.0'))
print('asked for:', launch_server.get_server_name('127.0.0.1'))
"""


def test_an_offline_node_serves_on_the_wildcard():
    """In a network namespace of its own (loopback only, down), finding the host ip fails ('Network is
    unreachable'): lmdeploy's launcher raised it and no dp server started. Now the servers bind to the wildcard (with
    a warning), or to the address asked for."""
    try:
        done = subprocess.run(['unshare', '--net', sys.executable, '-c', _OFFLINE], capture_output=True, text=True,
                              timeout=120)
    except FileNotFoundError:
        pytest.skip('no unshare on this machine')
    if 'unshare failed' in done.stderr or 'Operation not permitted' in done.stderr:
        pytest.skip(f'no network namespace for this user: {done.stderr.strip()[-200:]}')
    assert done.returncode == 0, done.stderr[-3000:]
    said = {line.split(':', 1)[0]: line.split(':', 1)[1].strip() for line in done.stdout.splitlines()
            if line.startswith(('host ip:', 'server name:', 'asked for:'))}
    assert 'unreachable' in said['host ip'], done.stdout
    assert said['server name'] == '0.0.0.0' and said['asked for'] == '127.0.0.1', done.stdout
    # lmdeploy's logger writes to stdout
    assert 'Failed to get the host ip' in done.stdout + done.stderr, done.stdout
