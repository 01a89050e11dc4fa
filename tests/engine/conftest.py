"""Engine tests run lmdeploy's own modules, patched by the series, on CPU tensors.

lmdeploy's Triton kernels run under the Triton interpreter, which has to be switched on before lmdeploy is
imported.
"""
import pytest

from lmdeploy_guided_spec.support.harness import enable_cpu_triton

enable_cpu_triton()


def pytest_collection_modifyitems(config, items):
    from lmdeploy.pytorch.spec_decode import spec_agent
    if not hasattr(spec_agent, '_PER_ROW_FIELDS'):
        raise pytest.UsageError('the installed lmdeploy is not patched; run `lmdeploy-guided-spec apply` first')
