"""_expand_sampling_inputs / _slice_sampling_inputs carry every SamplingInputs field, tensors and Python alike."""
from dataclasses import fields

import numpy as np
import pytest
import torch
from lmdeploy.pytorch.engine.logits_process import SamplingInputs
from lmdeploy.pytorch.spec_decode import spec_agent

pytestmark = pytest.mark.engine

B, K = 3, 3  # batch size, num_spec_tokens
N = K + 1

# batch-wide fields: the same for every row, passed through unchanged
BATCH_WIDE = {'max_top_k', 'min_top_p', 'max_num_logprobs', 'batch_size', 'session_to_cleanup',
              'max_repetition_ngram_size', 'has_min_new_tokens'}


def _full_inputs():
    return SamplingInputs(
        temperature=torch.tensor([0.5, 1.0, 2.0]),
        bad_words=torch.tensor([[1, 2], [3, 4], [5, 6]]),
        bad_mask=torch.tensor([[True, False], [True, True], [False, False]]),
        stop_words=torch.tensor([[7], [8], [9]]),
        stop_mask=torch.ones(B, 1, dtype=torch.bool),
        repetition_penalty=torch.tensor([1.0, 1.1, 1.2]),
        top_k=torch.tensor([1, 5, 0]),
        top_p=torch.tensor([0.9, 0.8, 1.0]),
        min_p=torch.tensor([0.0, 0.1, 0.2]),
        random_seeds=torch.tensor([11, 12, 13]),
        random_offsets=torch.tensor([100, 200, 300]),
        max_top_k=5,
        min_top_p=0.8,
        response_formats=({'type': 'json_object'}, None, {'type': 'regex_schema', 'regex_schema': 'a+'}),
        logits_processors=[None, [lambda ids, x: x], None],
        max_num_logprobs=2,
        all_ids=torch.arange(B * 4).view(B, 4),
        num_ignore_eos=torch.tensor([0, 1, 2]),
        batch_size=B,
        session_ctx=[{'session_id': s, 'seq_id': s} for s in (21, 22, 23)],
        session_to_cleanup=[5, 6],
        generated_ids=torch.arange(B * 2).view(B, 2),
        generated_ids_cpu=np.arange(B * 2).reshape(B, 2),
        repetition_ngram_size=torch.tensor([2, 3, 4]),
        repetition_ngram_threshold=torch.tensor([1, 1, 2]),
        max_repetition_ngram_size=4,
        has_min_new_tokens=True,
    )


def test_every_field_is_classified():
    """A new SamplingInputs field must be a tensor, a known per-row field or a known batch-wide field."""
    inputs = _full_inputs()
    for f in fields(inputs):
        value = getattr(inputs, f.name)
        assert value is not None, f'fill {f.name} in _full_inputs'
        assert (isinstance(value, torch.Tensor) or f.name in spec_agent._PER_ROW_FIELDS or f.name in BATCH_WIDE), \
            f'SamplingInputs.{f.name} is neither a tensor nor classified as per-row or batch-wide'


def _rows(value):
    return list(value) if not isinstance(value, np.ndarray) else [row.tolist() for row in value]


def test_expand_then_slice_round_trip():
    inputs = _full_inputs()
    expanded = spec_agent._expand_sampling_inputs(inputs, N)
    assert expanded.batch_size == B * N
    for name in spec_agent._PER_ROW_FIELDS:
        original, grown = _rows(getattr(inputs, name)), _rows(getattr(expanded, name))
        assert len(grown) == B * N, name
        for i, item in enumerate(grown):
            assert item is original[i // N] or item == original[i // N], (name, i)
    assert isinstance(expanded.response_formats, tuple) and isinstance(expanded.session_ctx, list)
    assert expanded.session_to_cleanup == [5, 6] and expanded.max_top_k == 5
    # random offsets differ per position
    assert expanded.random_offsets.tolist() == [o + i for o in (100, 200, 300) for i in range(N)]

    last = spec_agent._slice_sampling_inputs(expanded, N, is_last=True)
    assert last.batch_size == B
    for f in fields(inputs):
        a, b = getattr(inputs, f.name), getattr(last, f.name)
        if f.name == 'random_offsets':
            assert torch.equal(b, a + K)
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f.name
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b), f.name
        else:
            assert a == b or _rows(a) == _rows(b), f.name

    drafts = spec_agent._slice_sampling_inputs(expanded, N, is_last=False)
    assert drafts.batch_size == B * K
    for name in spec_agent._PER_ROW_FIELDS:
        original, sliced = _rows(getattr(inputs, name)), _rows(getattr(drafts, name))
        assert len(sliced) == B * K
        assert all(item is original[i // K] or item == original[i // K] for i, item in enumerate(sliced)), name
    assert torch.equal(drafts.temperature, inputs.temperature.repeat_interleave(K))


def test_one_token_is_identity():
    inputs = _full_inputs()
    assert spec_agent._expand_sampling_inputs(inputs, 1) is inputs
    assert spec_agent._slice_sampling_inputs(inputs, 1) is inputs
