"""``response_format`` through the OpenAI client, against a running ``lmdeploy serve api_server``.

Start a server first (examples/README.md), for example on the CPU path:

    .venv/bin/lmdeploy-guided-spec serve-cpu tiny-llama --backend pytorch \
        --speculative-algorithm eagle3 --speculative-draft-model tiny-llama-eagle3 \
        --speculative-num-draft-tokens 3 --server-port 23333

then:

    .venv/bin/python examples/openai_client.py --base-url http://localhost:23333/v1
"""
from __future__ import annotations

import argparse
import json

from openai import OpenAI

SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string', 'maxLength': 24},
        'age': {'type': 'integer', 'minimum': 0, 'maximum': 130},
    },
    'required': ['name', 'age'],
    'additionalProperties': False,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--base-url', default='http://localhost:23333/v1')
    parser.add_argument('--max-tokens', type=int, default=96)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key='none')
    model = client.models.list().data[0].id
    response_format = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': SCHEMA}}
    messages = [{'role': 'user', 'content': 'Describe a famous mathematician as JSON.'}]

    completion = client.chat.completions.create(model=model, messages=messages, response_format=response_format,
                                                max_completion_tokens=args.max_tokens, temperature=0)
    text = completion.choices[0].message.content
    print(f'{model}: {text}')

    # the same request, streamed: the chunks put together are JSON of the schema as well
    chunks = client.chat.completions.create(model=model, messages=messages, response_format=response_format,
                                            max_completion_tokens=args.max_tokens, temperature=0, stream=True)
    streamed = ''.join(chunk.choices[0].delta.content or '' for chunk in chunks if chunk.choices)
    print(f'streamed: {streamed}')

    finished = completion.choices[0].finish_reason == 'stop'
    if finished:
        person = json.loads(text)
        assert set(person) == {'name', 'age'}, person
    return 0 if finished and streamed == text else 1


if __name__ == '__main__':
    raise SystemExit(main())
