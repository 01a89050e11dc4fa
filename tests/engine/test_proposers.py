"""Proposers' get_outputs with draft logits from a small stub module, with and without a DraftGrammar."""
import pytest
import torch
from lmdeploy.pytorch.config import SpecDecodeConfig
from lmdeploy.pytorch.model_inputs import ModelInputs
from lmdeploy.pytorch.spec_decode.proposers.base import build_specdecode_proposer
from lmdeploy.pytorch.strategies.ar_spec.model_agent import ARSpecExtraInputs

from lmdeploy_guided_spec import SpecGrammarManager, testing

from grammars import SCHEMAS, compile_schema, new_matcher

pytestmark = pytest.mark.engine

V = 128256


class _StubDraft(torch.nn.Module):
    """get_logits returns a fixed logits table; the hidden states only select rows."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def get_logits(self, hidden_states):
        return self.logits[None, :hidden_states.shape[1]].clone()


def _inputs(batch):
    return ModelInputs(input_ids=torch.zeros(1, batch, dtype=torch.long),
                       seq_length=torch.ones(batch, dtype=torch.long),
                       history_lengths=torch.zeros(batch, dtype=torch.long),
                       block_offsets=torch.zeros(batch, 1, dtype=torch.long), is_decoding=True,
                       num_ignored_history=torch.zeros(batch, dtype=torch.long), max_q_seqlen=1, max_kv_seqlen=1,
                       sum_kv_seqlen=batch)


def _proposer(method, logits, ids=None):
    proposer = build_specdecode_proposer(SpecDecodeConfig(model='stub', method=method, num_speculative_tokens=2),
                                         device='cpu')
    proposer.model = _StubDraft(logits)
    if ids is not None:
        proposer.draft_id_to_target_id = ids
    return proposer


def _outputs(batch):
    hidden = torch.zeros(1, batch, 8)
    return {'hidden_states': hidden, 'hidden_states_prenorm': hidden, 'model_metas': None}


@pytest.mark.parametrize('method', ['deepseek_mtp', 'eagle', 'qwen3_5_mtp', 'eagle3'])
def test_get_outputs_masks_guided_rows_only(method):
    compiled = compile_schema('llama3', SCHEMAS['person'])
    allowed = testing.allowed_tokens(new_matcher(compiled), V)
    ids = None
    if method == 'eagle3':
        # a draft vocabulary holding some of the tokens the grammar allows first
        ids = torch.unique(torch.cat([torch.randperm(V)[:20000], allowed.nonzero()[::3, 0]]))
    width = V if ids is None else ids.numel()
    logits = torch.randn(3, width)
    extra = ARSpecExtraInputs(last_token_indices=torch.arange(3))

    plain, _, _ = _proposer(method, logits, ids).get_outputs(_outputs(3), _inputs(3), extra)
    expected_plain = logits.argmax(-1, keepdim=True)
    if ids is not None:
        expected_plain = ids[expected_plain]
    assert torch.equal(plain, expected_plain), 'without a DraftGrammar get_outputs is unchanged'

    committed = {0: new_matcher(compiled), 2: new_matcher(compiled)}
    draft = SpecGrammarManager(V).begin_draft(committed, 3, draft_id_to_target_id=ids)
    guided, _, _ = _proposer(method, logits, ids).get_outputs(_outputs(3), _inputs(3), extra, guided_draft=draft)
    assert guided[1] == plain[1], 'the unguided row keeps its argmax'
    for row in (0, 2):
        assert allowed[guided[row]], 'guided drafts are grammar-valid target ids'
        candidates = allowed if ids is None else allowed[ids]
        best = logits[row].masked_fill(~candidates, float('-inf')).argmax()
        assert int(guided[row]) == int(best if ids is None else ids[best])
    # the forks advanced; the committed matchers did not
    assert not draft.dead
    assert torch.equal(testing.allowed_tokens(committed[0], V), allowed)
