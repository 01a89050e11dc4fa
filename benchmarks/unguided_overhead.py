"""What the patches cost a batch without any guided request.

With no ``response_format`` in the batch, every patched call site of the spec agent returns after one check
(``SpecModelAgent._get_guided_matchers`` finds no guided row; no mask is filled, copied or applied and nothing is
allocated). This measures that check on a batch of 32 unguided requests, and the whole speculative step (lmdeploy's
rejection sampling and drafting through the patched agent, scripted networks, Triton kernels under the
interpreter) with the grammar wiring present and with it switched off (``guided_decoding_manager=None``, which is
the pristine code path), interleaved.

Last line: ``unguided_step_overhead_us <median step time with wiring - without, microseconds>``.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from lmdeploy_guided_spec.support.harness import GenRequest, SpecHarness, _sampling_inputs, enable_cpu_triton


def main() -> int:
    enable_cpu_triton()
    from lmdeploy_guided_spec import testing
    tok = testing.load_tokenizer('llama3')
    vocab = testing.TOKENIZERS['llama3'].model_vocab_size
    batch = 32

    def model(prefix):
        g = torch.Generator().manual_seed(len(prefix))
        return torch.randn(vocab, generator=g)

    harness = SpecHarness(tok, vocab, model, model, num_spec_tokens=3)
    requests = [GenRequest(i + 1, None, 10**6) for i in range(batch)]
    sampling_inputs = _sampling_inputs(requests, tok.eos_token_id)
    agent = harness.agent
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        agent._get_guided_matchers(sampling_inputs)
    check_us = (time.perf_counter() - start) / n * 1e6

    wiring = (agent.guided_decoding_manager, agent.guided_spec)
    samples = {'with wiring': [], 'without': []}
    for rep in range(7):
        for name in (('with wiring', 'without') if rep % 2 else ('without', 'with wiring')):
            agent.guided_decoding_manager, agent.guided_spec = wiring if name == 'with wiring' else (None, None)
            reqs = [GenRequest(i + 1, None, 12) for i in range(batch)]
            harness.records.clear()
            harness.target_forwards = 0
            start = time.perf_counter()
            harness.generate(reqs)
            samples[name].append((time.perf_counter() - start) / harness.target_forwards)
    agent.guided_decoding_manager, agent.guided_spec = wiring
    med = {k: statistics.median(v) for k, v in samples.items()}
    diff_us = (med['with wiring'] - med['without']) * 1e6
    print(f'unguided batch of {batch}, 3 draft tokens, lmdeploy spec agent on CPU (scripted networks)')
    print(f'{"":<28} {"per call / step":>16}')
    print(f'{"guided-row check":<28} {check_us:>13.2f} us  (called twice per step)')
    print(f'{"step, with grammar wiring":<28} {med["with wiring"] * 1e3:>13.1f} ms')
    print(f'{"step, without":<28} {med["without"] * 1e3:>13.1f} ms')
    print(f'{"difference":<28} {diff_us:>13.0f} us ({diff_us / (med["without"] * 1e6) * 100:+.2f} %, '
          f'noise level; the added work is the check above)')
    print(f'unguided_step_overhead_us {diff_us:.0f}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
