"""vLLM's FSM speculation example with lmdeploy: build a token FSM, save it in vLLM's format, generate with it.

The FSM writes "hello world", lets the model choose " test" or " example", and ends with EOS. It is built with
:class:`lmdeploy_guided_spec.FsmBuilder` (``graph[state][token_id] = next_state``, as vLLM's ``CustomFSM``) and
saved as vLLM saves it, so the same file serves vLLM's ``speculative_config={'method': 'fsm', 'fsm_path': ...}``.

On the CPU path (no GPU; the built-in tiny model, random weights, so only the FSM decides the words)::

    LMDEPLOY_GUIDED_SPEC_DEVICE=cpu .venv/bin/python examples/fsm_vllm_format.py

With a GPU and a model of your own (any Llama-3 or other tokenizer; the token ids come from it)::

    .venv/bin/python examples/fsm_vllm_format.py --model /models/Llama-3.1-8B-Instruct
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from lmdeploy_guided_spec import FsmBuilder


def build_fsm(tokenizer) -> FsmBuilder:
    """vLLM's example: "hello world" then " test" or " example", then EOS."""
    def token(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1, f'{text!r} is {len(ids)} tokens for this tokenizer'
        return ids[0]

    hello, world, test, example = (token(t) for t in ('hello', ' world', ' test', ' example'))
    eos = tokenizer.eos_token_id
    fsm = FsmBuilder()
    fsm.graph[0] = {hello: 1}
    fsm.graph[1] = {world: 2}
    fsm.graph[2] = {test: 3, example: 4}  # the branch: the model chooses
    fsm.graph[3] = {eos: 5}  # states 5 and 6 follow EOS: they are not in the graph, as in vLLM's example
    fsm.graph[4] = {eos: 6}
    return fsm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', help='model path (default on the CPU path: the built-in tiny-llama)')
    parser.add_argument('--num-speculative-tokens', type=int, default=3)
    args = parser.parse_args()

    on_cpu = os.environ.get('LMDEPLOY_GUIDED_SPEC_DEVICE') == 'cpu'
    model = args.model
    if model is None:
        if not on_cpu:
            parser.error('give --model, or set LMDEPLOY_GUIDED_SPEC_DEVICE=cpu for the built-in tiny model')
        from lmdeploy_guided_spec.cpu import models
        model = models.resolve('tiny-llama')
    if on_cpu:
        from lmdeploy_guided_spec import cpu
        cpu.activate()

    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig
    from transformers import AutoTokenizer

    fsm = build_fsm(AutoTokenizer.from_pretrained(model))
    with tempfile.TemporaryDirectory() as tmp:
        fsm_path = Path(tmp) / 'fsm.json'
        fsm.save(fsm_path)
        print(f'FSM file (vLLM format): {fsm_path.read_text()}')
        backend_config = PytorchEngineConfig(cache_max_entry_count=0.1 if on_cpu else 0.8)
        speculative_config = SpeculativeConfig(method='fsm', fsm_path=str(fsm_path),
                                               num_speculative_tokens=args.num_speculative_tokens)
        with pipeline(model, backend_config=backend_config, speculative_config=speculative_config,
                      log_level='ERROR') as pipe:
            outputs = pipe(['Generate text:'], gen_config=GenerationConfig(max_new_tokens=10, do_sample=False))
    for output in outputs:
        print(f'Generated: {output.text!r} (finish_reason={output.finish_reason})')
        assert output.text in ('hello world test', 'hello world example'), output.text


if __name__ == '__main__':
    main()
