"""Through lmdeploy's own ``pipeline``, on every release with a series: each host read of device token ids by the
grammar worker waits for an event recorded on the thread that launched the kernel writing them (the engine's).

lmdeploy launches its kernels under ``torch.cuda.stream(...)``, and the current stream is per thread; the grammar
worker reads draft and accepted ids on a thread of its own, so the event it waits for must come from the engine's
thread (defect 3 of the issue "The engine never dies, never stalls, never drops the grammar"). The CPU path has no
streams: here every thread gets a stream of its own (``record_ready`` returns an event naming the thread that
recorded it), and every checked read names the thread its event came from. The engine thread is the one that runs
the spec agent's ``async_sampling_logits``. ``tests/engine/test_stream_ordering.py`` checks the same with the
scripted harness on lmdeploy 0.14.0.
"""
import threading

import pytest
from e2e_helpers import METHODS, PROMPTS, check_valid, gen_config, generate, response_format


@pytest.fixture(scope='module')
def engine_threads(cpu_path):
    """The threads that ran a spec agent's ``async_sampling_logits`` while this module ran (every engine's, also an
    engine still finishing the previous test's last step)."""
    from lmdeploy.pytorch.spec_decode.spec_agent import SpecModelAgent
    threads: set = set()
    sampling_logits = SpecModelAgent.async_sampling_logits

    async def async_sampling_logits(self, *args, **kwargs):
        threads.add(threading.current_thread())
        return await sampling_logits(self, *args, **kwargs)

    SpecModelAgent.async_sampling_logits = async_sampling_logits
    yield threads
    SpecModelAgent.async_sampling_logits = sampling_logits


@pytest.fixture
def per_thread_streams(monkeypatch):
    """``install()`` puts the double in place and returns ``reads``: per checked read, the thread its event came
    from (None: no event)."""
    from lmdeploy.pytorch.spec_decode import spec_agent

    from lmdeploy_guided_spec import testing

    def install():
        reads: list = []
        testing._per_thread_streams(monkeypatch, reads, spec_agent)
        return reads

    return install


@pytest.mark.one_method({'0.18': ['eagle3'], '0.14': ['deepseek_mtp']})
@pytest.mark.parametrize('method', list(METHODS))
def test_worker_reads_of_device_ids_wait_for_the_engine_threads_event(engines, engine_threads, per_thread_streams,
                                                                      method):
    target = METHODS[method]
    fmt = response_format('json_schema')
    configs = [gen_config(fmt), gen_config(None, max_new_tokens=12), gen_config(fmt)]
    plain = generate(engines(target, spec=False), PROMPTS[:3], configs)
    pipe = engines(target, spec=True)
    reads = per_thread_streams()
    outputs = generate(pipe, PROMPTS[:3], configs)
    assert engine_threads, 'the spec agent never sampled'
    assert reads, 'no host read of device token ids was checked'
    unordered = [thread for thread in reads if thread not in engine_threads]
    assert not unordered, (f'{len(unordered)} of {len(reads)} reads of device token ids waited for '
                           f'{sorted({getattr(t, "name", "no event") for t in unordered})[:4]}, not for the engine '
                           f'thread {sorted(t.name for t in engine_threads)}')
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    for out, config in zip(outputs, configs):
        if config.response_format is not None:
            check_valid(out.text, fmt)
