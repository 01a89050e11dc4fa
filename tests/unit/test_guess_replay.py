"""benchmarks/guess_replay.py: the replay counts the target forwards the draft-free method takes on an output."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import xgrammar as xgr
from test_guess import _decode, _manager, needs_smollm2

pytestmark = [pytest.mark.unit, needs_smollm2]

ROOT = Path(__file__).resolve().parents[2]


def _replay_module():
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    spec = importlib.util.spec_from_file_location('guess_replay', ROOT / 'benchmarks' / 'guess_replay.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_counts_the_forwards_of_greedy_speculation(tmp_path, capsys):
    """Two requests (an extraction whose values are in the prompt, and an object): the replay's forwards are those of
    greedy speculation through the same core calls, plus the one the engine runs after the last token."""
    replay = _replay_module()
    tok, info, vocab = replay.tokenizer_and_info()
    schema = {'type': 'object', 'properties': {'city': {'type': 'string'}, 'year': {'type': 'integer'}},
              'required': ['city', 'year']}
    instance = {'city': 'San Francisco de Campeche', 'year': 1540}
    requests = []
    for kind, text in (('extract', f'Notes: city: {instance["city"]}\nyear: {instance["year"]}'),
                       ('object', 'Produce one JSON object.')):
        messages = [{'role': 'user', 'content': text}]
        tokens = tok.encode(json.dumps(instance, indent=2), add_special_tokens=False) + [-1]
        requests.append(dict(id=f'cat/name/{kind}/any', kind=kind, whitespace='any', messages=messages,
                             schema=schema, tokens=tokens, forwards={}))
    dump = tmp_path / 'dump.json'
    dump.write_text(json.dumps(requests))
    assert replay.main([str(dump)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: int(line.split()[2]) for line in out.splitlines() if line.startswith('cat/')}
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    manager = _manager('smollm2')
    for session, request in enumerate(requests):
        prompt = tok.apply_chat_template(request['messages'], add_generation_prompt=True, tokenize=True)
        output, seq, forwards, _ = _decode(manager, request['tokens'][:-1], (None, compiled), prompt=prompt,
                                           session=session)
        assert output == seq
        assert rows[request['id']] == forwards + 1, (request['id'], out)
    assert rows['cat/name/extract/any'] < rows['cat/name/object/any'], 'the prompt holds the values'
    assert out.strip().splitlines()[-1].startswith('replay_tokens_per_forward ')
