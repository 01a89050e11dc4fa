"""Engine tests run lmdeploy's own modules, patched by the series, on CPU tensors.

lmdeploy's Triton kernels run under the Triton interpreter, which has to be switched on before lmdeploy is
imported.
"""
import pytest

from lmdeploy_guided_spec.support.harness import enable_cpu_triton

enable_cpu_triton()


def pytest_collection_modifyitems(config, items):
    from lmdeploy_guided_spec.series.files import find_series
    from lmdeploy_guided_spec.series.installed import locate_installed
    from lmdeploy_guided_spec.series.patching import status
    target = locate_installed()
    if status(target, find_series(target.version)).overall != 'applied':
        raise pytest.UsageError('the installed lmdeploy is not patched; run `lmdeploy-guided-spec apply` first')
