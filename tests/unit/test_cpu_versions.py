"""The CPU path picks one backend module per lmdeploy release line, from the installed lmdeploy."""
from __future__ import annotations

from importlib.metadata import version

import pytest

from lmdeploy_guided_spec import cpu


@pytest.mark.parametrize('given, series', [('0.14.0', '0.14'), ('0.18.0', '0.18'), ('0.18.0rc1', '0.18'),
                                           ('0.18.1', '0.18'), ('1.2.3.post1', '1.2')])
def test_the_release_line_of_a_version(given, series):
    assert cpu.lmdeploy_series(given) == series


def test_the_installed_lmdeploy_gets_its_own_backend_module():
    module = cpu.backend_module()
    assert module.__name__ == f'lmdeploy_guided_spec.cpu.{cpu.BACKEND_MODULES[cpu.lmdeploy_series()]}'
    assert cpu.lmdeploy_series() == '.'.join(version('lmdeploy').split('.')[:2])
    from lmdeploy.pytorch.backends.cuda.op_backend import CudaOpsBackend
    assert issubclass(module.CpuOpsBackend, CudaOpsBackend)
    assert module.CpuOpsBackend.get_name() == 'cpu'
    assert set(module.replaced()) and all(module.replaced().values())


def test_an_unsupported_version_is_refused_with_the_supported_ones():
    with pytest.raises(RuntimeError, match=r'supports lmdeploy 0\.14\.x, 0\.18\.x, not 0\.9\.0'):
        cpu.backend_module('0.9.0')
