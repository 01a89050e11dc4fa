"""Dummy forwards of an idle DP rank (defect 2 of the issue "The engine never dies, never stalls, never drops the
grammar"): lmdeploy runs them with ``sampling_inputs=None``; the patched spec agent read it and stopped the engine."""
import asyncio

import pytest
import torch

from lmdeploy_guided_spec import testing
from lmdeploy_guided_spec.support.harness import GenRequest, SpecHarness, _model_inputs

from models import PrefixLM

pytestmark = pytest.mark.engine

V = 128256


def _dummy(batch: int, seq_len: int, is_decoding: bool):
    inputs = _model_inputs(batch, seq_len, is_decoding)
    inputs.is_dummy = True
    return inputs


@pytest.mark.parametrize('method', ['deepseek_mtp', 'grammar'])
def test_dummy_steps_without_sampling_inputs(method):
    from lmdeploy.pytorch.strategies.ar_spec.model_agent import ARSpecExtraInputs
    tok = testing.load_tokenizer('llama3')
    target = PrefixLM(V, [1, 2, 3], bias=9.0, seed=1)
    draft = None if method == 'grammar' else PrefixLM(V, [1, 2, 3], bias=4.0, seed=2)
    h = SpecHarness(tok, V, target, draft, method=method, num_spec_tokens=3)
    h._batch = [GenRequest(1, None, 4)]
    h._window = [[]]
    k = h.num_spec_tokens

    async def steps():
        # sampling of the dummy prefill and decode outputs
        for decoding, width in ((False, 1), (True, k + 1)):
            extra = ARSpecExtraInputs(target_logits=torch.zeros(width, V),
                                      output_draft_token_ids=torch.zeros(1, k, dtype=torch.long))
            out = await h.agent.async_sampling_logits(_dummy(1, width, decoding), extra, None)
            assert out.output_token_ids.shape == (1, width)
        # the draft loop of a dummy decode step
        extra = ARSpecExtraInputs(last_token_indices=torch.arange(1),
                                  num_rejected_tokens=torch.zeros(1, dtype=torch.long))
        forward = h.agent.async_model_forward if h.draft_free else h.agent._async_model_forward
        out = await forward(_dummy(1, 1, True), extra, None)
        assert out.output_draft_token_ids.shape == (1, k)

    asyncio.run(steps())
