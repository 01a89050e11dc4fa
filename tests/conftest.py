"""Shared fixtures."""
import pytest
import torch


@pytest.fixture(scope='session', params=['llama3', 'qwen3', 'deepseek'])
def tokenizer_name(request):
    return request.param


@pytest.fixture(scope='session')
def llama3():
    return 'llama3'


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Tests that build lmdeploy 0.14.0's internals by hand (its SpecModelAgent through the scripted harness, its
# proposers' get_outputs, its Triton attention backend, its rejection-sampling kernels) skip on other releases,
# which rebuilt that code; CI runs them against lmdeploy 0.14.0 (.venv-0.14.0/, tests/lmdeploy-0.14.0.txt). The
# same behaviour is checked on every release through lmdeploy's own pipeline and api_server (tests/e2e).
ONLY_LMDEPLOY_0_14 = {
    'tests/engine/test_check_command.py': 'the check command drives 0.14.0\'s speculative agent',
    'tests/engine/test_spec_agent.py': 'the scripted harness builds 0.14.0\'s SpecModelAgent',
    'tests/engine/test_spec_agent_forced.py': 'the scripted harness builds 0.14.0\'s SpecModelAgent',
    'tests/engine/test_sampling_fields.py': 'the expand/slice of sampling inputs is 0.14.0\'s series\' (later '
                                            'releases do it themselves)',
    'tests/engine/test_dummy_steps.py::test_dummy_steps_without_sampling_inputs': 'the scripted harness builds '
                                                                                  '0.14.0\'s SpecModelAgent',
    'tests/engine/test_proposers.py::test_get_outputs_masks_guided_rows_only': '0.14.0\'s proposers\' get_outputs',
    'tests/engine/test_stream_ordering.py::test_worker_reads_of_device_ids_wait_for_the_engine_threads_event':
        'the scripted harness builds 0.14.0\'s SpecModelAgent',
    'tests/engine/test_paged_decode_causal.py::test_backend_decodes_a_speculative_window_causally':
        '0.14.0\'s TritonAttentionBuilder',
    'tests/e2e/test_cpu_kernels.py::test_rejection_greedy_kernel': '0.14.0\'s rejection-sampling kernels',
    'tests/e2e/test_cpu_kernels.py::test_rejection_random_and_recovered_kernels': '0.14.0\'s rejection-sampling '
                                                                                  'kernels',
    'tests/e2e/test_cpu_kernels.py::test_paged_decode_attention': '0.14.0\'s paged attention kernel signature',
    'tests/unit/test_tiny_models.py::test_lmdeploy_loads_every_parameter[deepseek': 'later releases\' DeepSeek '
        'layers ask CUDA for the device when built outside the CPU path (the e2e tests load it through the path)',
}


def _one_method(item, installed: str) -> str | None:
    """Why ``item`` is skipped by its ``one_method`` mark on lmdeploy ``installed``, or None where it runs. The mark
    maps a release (``'0.18'``) to the methods its default suite runs; a release it does not name runs every one."""
    mark = item.get_closest_marker('one_method')
    callspec = getattr(item, 'callspec', None)
    if mark is None or callspec is None or 'method' not in callspec.params:
        return None
    release = '.'.join(installed.split('.')[:2])
    methods = mark.args[0].get(release)
    if methods is None or callspec.params['method'] in methods:
        return None
    return (f'a long check the default suite makes with {", ".join(methods)} on lmdeploy {release} (each release '
            f'with other methods); --every-method runs it with this one too')


def pytest_collection_modifyitems(config, items):
    from importlib.metadata import PackageNotFoundError, version
    try:
        installed = version('lmdeploy')
    except PackageNotFoundError:
        return
    if not config.getoption('--every-method'):
        for item in items:
            why = _one_method(item, installed)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=why))
    if installed.startswith('0.14.'):
        return
    for item in items:
        for prefix, why in ONLY_LMDEPLOY_0_14.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=f'lmdeploy {installed} is installed; this test drives '
                                                        f'{why}: CI runs it against lmdeploy 0.14.0'))
