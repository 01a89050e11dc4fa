"""Traffic for a running api_server, through the openai client: concurrent greedy and sampling requests of every
format, streaming and not, and clients that disconnect mid-stream (``test_server_traffic.py`` on one rank,
``test_ranks.py`` on two)."""
from __future__ import annotations

import asyncio
import urllib.request

import openai
from e2e_helpers import check_valid, response_format

KINDS = ('json_schema', 'json_object', 'regex_schema', 'text')


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)


async def request(api: openai.AsyncOpenAI, model: str, i: int, kind: str, sampling: bool, streaming: bool):
    """One chat request of a kind: ``(response_format, text, finish_reason)``."""
    fmt = response_format(kind)
    kwargs = dict(model=model, messages=[{'role': 'user', 'content': f'Request {i}: a record, please.'}],
                  max_tokens=96 if kind != 'text' else 16, temperature=0.8 if sampling else 0.0, seed=i)
    if fmt is not None:
        kwargs['response_format'] = fmt
    if not streaming:
        choice = (await api.chat.completions.create(**kwargs)).choices[0]
        return fmt, choice.message.content, choice.finish_reason
    text, reason = '', None
    async for chunk in await api.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ''
            reason = chunk.choices[0].finish_reason or reason
    return fmt, text, reason


async def mixed_round(base: str, round_: int, concurrent: int):
    """``concurrent`` requests at once, cycling through the kinds, greedy and sampling, streaming and not."""
    api = client(base)
    model = (await api.models.list()).data[0].id
    jobs = [request(api, model, 100 * round_ + i, KINDS[i % 4], sampling=(i // 4) % 2 == 1,
                    streaming=(i // 8) % 2 == 1) for i in range(concurrent)]
    return await asyncio.gather(*jobs)


def check_round(results) -> None:
    """Guided requests stop with valid output; unguided ones stop or reach their length."""
    for fmt, text, reason in results:
        if fmt is None:
            assert reason in ('stop', 'length'), (text, reason)
        else:
            assert reason == 'stop', (fmt, text, reason)
            check_valid(text, fmt)


async def disconnects(base: str, n: int):
    """``n`` streams dropped after their second chunk, each beside a request that runs to its end; returns the
    results of those."""
    api = client(base)
    model = (await api.models.list()).data[0].id

    async def dropped(i: int):
        stream = await api.chat.completions.create(
            model=model, messages=[{'role': 'user', 'content': f'Drop {i}.'}], max_tokens=96, stream=True,
            response_format=response_format(KINDS[i % 3]), temperature=0.8 if i % 2 else 0.0)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()

    jobs = []
    for i in range(n):
        jobs.append(dropped(i))
        jobs.append(request(api, model, 1000 + i, KINDS[i % 3], sampling=False, streaming=i % 2 == 0))
    results = await asyncio.gather(*jobs)
    return [r for r in results if r is not None]


async def one(base: str, kind: str):
    """One greedy request of a kind."""
    api = client(base)
    model = (await api.models.list()).data[0].id
    return await request(api, model, 7, kind, sampling=False, streaming=False)


def health(base: str) -> int:
    return urllib.request.urlopen(f'{base}/health', timeout=10).status
