"""The test servers' ports: below the kernel's ephemeral range, where no socket bound to port 0 (a client's end of a
connection, an engine process's socket) takes them while a server starts."""
import socket
from pathlib import Path

import pytest

from lmdeploy_guided_spec.testing import free_port

pytestmark = pytest.mark.unit


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low = int(Path('/proc/sys/net/ipv4/ip_local_port_range').read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10000 <= port < max(low, 12000) for port in ports), ports
    with socket.socket() as s:
        s.bind(('127.0.0.1', ports[0]))
