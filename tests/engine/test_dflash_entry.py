"""A guided request on an engine that speculates with lmdeploy 0.18.0's DFlash (patch 0077), driven through the
engine's own entry check, ``Engine._on_add_message``.

DFlash's proposer raises NotImplementedError for a guided request inside the forward loop, and the engine loop
ended there: every request in flight failed, and the api_server answered HTTP 503 to every request after it. The
CPU path cannot run DFlash (no tiny draft model, and its draft layers attend without a causal mask), so the entry
check runs on an engine object without a model: the request must fail alone at the entry, before any forward.
"""
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.engine

pytest.importorskip('lmdeploy.pytorch.spec_decode.proposers.dflash', reason='this lmdeploy has no DFlash')


def _entry(method: str | None):
    """An Engine without a model: what its entry check answered, and which requests it added."""
    from lmdeploy.pytorch.engine.engine import Engine
    engine = object.__new__(Engine)
    answered, added = [], []
    engine.specdecode_config = None if method is None else SimpleNamespace(method=method, num_speculative_tokens=3)
    engine.scheduler = None
    engine.executor = SimpleNamespace(model_config=SimpleNamespace(vocab_size=None))
    engine.guided_decoding_manager = None
    engine.input_processor = None
    engine._response = lambda resp, status, data=None, err_msg='': answered.append((resp, status, err_msg))
    engine._add_message = lambda reqs: added.extend(reqs)
    return engine, answered, added


def _request(session_id: int, response_format):
    return SimpleNamespace(resp=f'resp {session_id}',
                           data={'session_id': session_id, 'token_ids': [1, 2, 3],
                                 'sampling_param': SimpleNamespace(response_format=response_format)})


GUIDED = [{'type': 'json_object'},
          {'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': {'type': 'integer'}}},
          {'type': 'regex_schema', 'regex_schema': '[a-z]+'},
          {'type': 'structural_tag', 'format': {'type': 'const_string', 'value': 'x'}}]


@pytest.mark.parametrize('response_format', GUIDED, ids=lambda f: f['type'])
def test_dflash_fails_a_guided_request_alone_at_the_entry(response_format):
    from lmdeploy.messages import ResponseType
    engine, answered, added = _entry('dflash')
    guided, plain, text = _request(1, response_format), _request(2, None), _request(3, {'type': 'text'})
    engine._on_add_message([guided, plain, text])
    assert added == [plain, text]
    assert len(answered) == 1, answered
    resp, status, message = answered[0]
    assert resp == 'resp 1' and status == ResponseType.NOT_SUPPORTED, answered
    assert 'dflash' in message and 'grammar' in message, message


@pytest.mark.parametrize('method', [None, 'deepseek_mtp', 'eagle3', 'grammar'])
def test_other_methods_take_guided_requests(method):
    engine, answered, added = _entry(method)
    requests = [_request(i, response_format) for i, response_format in enumerate(GUIDED)]
    engine._on_add_message(requests)
    assert added == requests and answered == []
