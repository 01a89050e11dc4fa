"""Torch implementations of the lmdeploy kernels that the Triton interpreter runs too slowly on a CPU.

Each function has the signature and semantics of its namesake in ``lmdeploy.pytorch.kernels.cuda`` for the cases
the CPU path supports (no KV-cache quantization, no ALiBi, no attention sinks); anything else raises
``NotImplementedError`` instead of computing something different. Layouts: paged caches are ``bshd``
(``[num_blocks, block_size, heads, dim]``), the flattened KV of prefill is ``hsd``, as lmdeploy's Triton attention
uses them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ['fill_kv_cache', 'flash_attn_with_kvcache', 'flatten_kv_cache', 'flash_attn_varlen_func', 'fused_moe',
           'TorchLaunch', 'rejection_greedy_sample', 'rejection_random_sample', 'sample_recovered_tokens']


def _plain(quant_policy=0, kv_layout: str = 'bshd', **unsupported) -> None:
    if int(quant_policy) != 0:
        raise NotImplementedError(f'the CPU path has no quantized KV cache (quant_policy={quant_policy})')
    if kv_layout != 'bshd':
        raise NotImplementedError(f'the CPU path keeps paged caches in bshd layout, not {kv_layout}')
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f'the CPU attention has no {name}')


def _window(window_size) -> int:
    if window_size is None:
        return -1
    if isinstance(window_size, Sequence):
        return int(window_size[0])
    return int(window_size)


def _shares_storage(k_cache: Tensor, v_cache: Tensor | None) -> bool:
    return v_cache is not None and v_cache.data_ptr() == k_cache.data_ptr() and v_cache.size(-1) <= k_cache.size(-1)


def _token_slots(block_offsets: Tensor, positions: Tensor, rows: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Cache block and in-block offset of every (row, position)."""
    return block_offsets[rows, positions // block_size].long(), positions % block_size


def fill_kv_cache(k_states: Tensor, v_states: Tensor | None, k_caches: Tensor, v_caches: Tensor | None,
                  q_start_loc: Tensor, q_seq_length: Tensor, kv_seq_length: Tensor, max_q_seq_length: int,
                  block_offsets: Tensor, k_scales_zeros: Tensor = None, v_scales_zeros: Tensor = None,
                  quant_policy=0, kv_layout: str = 'bshd') -> None:
    """Write the new tokens' keys and values into their paged-cache slots.

    Token ``i`` of request ``b`` (``i < q_seq_length[b]``, read at ``q_start_loc[b] + i``) lands at sequence
    position ``kv_seq_length[b] - q_seq_length[b] + i``.
    """
    _plain(quant_policy, kv_layout)
    q_seq_length = q_seq_length.long()
    if int(q_seq_length.sum()) == 0:
        return
    block_size = k_caches.size(1)
    rows = torch.repeat_interleave(torch.arange(q_seq_length.numel()), q_seq_length)
    first = torch.cumsum(q_seq_length, 0) - q_seq_length
    within = torch.arange(rows.numel()) - first[rows]
    src = q_start_loc.long()[rows] + within
    positions = (kv_seq_length.long() - q_seq_length)[rows] + within
    blocks, offsets = _token_slots(block_offsets, positions, rows, block_size)
    k_caches[blocks, offsets] = k_states[src].to(k_caches.dtype)
    if v_states is not None and v_caches is not None and v_states.size(-1) > 0 and not _shares_storage(
            k_caches, v_caches):
        v_caches[blocks, offsets] = v_states[src].to(v_caches.dtype)


def _gather(cache: Tensor, block_offsets: Tensor, row: int, length: int) -> Tensor:
    """The first ``length`` positions of request ``row`` from a paged cache: ``[length, heads, dim]``."""
    block_size = cache.size(1)
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_offsets[row, :num_blocks].long()
    return cache[blocks].flatten(0, 1)[:length]


def _attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, softcap: float, window: int,
            causal: bool) -> Tensor:
    """Attention of ``q [sq, hq, d]`` over ``k [sk, hk, d]`` / ``v [sk, hk, dv]`` in float32.

    Query row ``t`` sees key positions ``<= q_pos[t]`` when causal (and ``>= q_pos[t] - window`` with a window).
    """
    hq, hk = q.size(1), k.size(1)
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    qf, kf, vf = q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if softcap is not None and softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(k.size(0))
    visible = torch.ones(q.size(0), k.size(0), dtype=torch.bool)
    if causal:
        visible &= key_pos[None, :] <= q_pos[:, None]
    if window > 0:
        visible &= key_pos[None, :] >= (q_pos - window)[:, None]
    scores = scores.masked_fill(~visible, float('-inf'))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    return torch.matmul(probs, vf).transpose(0, 1)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor = None, max_seqlen_q: int = None, softmax_scale: float = None,
                            causal: bool = False, window_size=None, softcap: float = None,
                            scheduler_metadata: Tensor = None, alibi_slopes: Tensor = None,
                            k_scales_zeros: Tensor = None, v_scales_zeros: Tensor = None, quant_policy=0,
                            sinks: Tensor = None, kv_layout: str = 'bshd') -> Tensor:
    """Decoding attention over the paged cache; every request has ``q.size(0) // batch`` query tokens.

    With several query tokens (a speculative window of ``s`` tokens) and ``causal``, token ``t`` sees positions
    ``< cache_seqlens - s + t + 1``; without ``causal`` every token sees the whole cache.
    """
    _plain(quant_policy, kv_layout, alibi_slopes=alibi_slopes, sinks=sinks)
    batch = cache_seqlens.size(0)
    seq_len = q.size(0) // batch
    scale = softmax_scale if softmax_scale is not None else q.size(-1)**-0.5
    window = _window(window_size)
    out = q.new_empty(*q.shape[:-1], v_cache.size(-1))
    lengths = cache_seqlens.tolist()
    for b, length in enumerate(lengths):
        rows = slice(b * seq_len, (b + 1) * seq_len)
        k = _gather(k_cache, page_table, b, length)
        v = _gather(v_cache, page_table, b, length)
        if causal:
            q_pos = torch.arange(length - seq_len, length)
        else:
            q_pos = torch.full((seq_len, ), length - 1)
        out[rows] = _attend(q[rows], k, v, q_pos, scale, softcap, window, True).to(out.dtype)
    return out


def flatten_kv_cache(k_caches: Tensor, v_caches: Tensor, seqlens: Tensor, block_offsets: Tensor,
                     start_loc: Tensor = None, out_size: int = None, out_dtype: torch.dtype = None,
                     k_scales_zeros: Tensor = None, v_scales_zeros: Tensor = None, quant_policy=0,
                     kv_layout: str = 'bshd', flatten_kv_layout: str = 'hsd') -> tuple[Tensor, Tensor]:
    """Copy each request's cached keys and values into one contiguous buffer, request ``b`` at ``start_loc[b]``."""
    _plain(quant_policy, kv_layout)
    out_dtype = out_dtype or k_caches.dtype
    if start_loc is None:
        start_loc = seqlens.cumsum(0) - seqlens
    if out_size is None or out_size <= 0:
        out_size = k_caches.size(0) * k_caches.size(1)
    heads = k_caches.size(2)
    k_out = k_caches.new_zeros(out_size, heads, k_caches.size(-1), dtype=out_dtype)
    v_out = v_caches.new_zeros(out_size, heads, v_caches.size(-1), dtype=out_dtype)
    for b, (start, length) in enumerate(zip(start_loc.tolist(), seqlens.tolist())):
        k_out[start:start + length] = _gather(k_caches, block_offsets, b, length)
        v_out[start:start + length] = _gather(v_caches, block_offsets, b, length)
    if flatten_kv_layout == 'hsd':
        return k_out.transpose(0, 1), v_out.transpose(0, 1)
    if flatten_kv_layout == 'shd':
        return k_out, v_out
    raise NotImplementedError(f'flatten layout {flatten_kv_layout}')


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor = None, cu_seqlens_k: Tensor = None,
                           max_seqlen_q: int = None, max_seqlen_k: int = None, softmax_scale: float = None,
                           causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                           q_start_loc: Tensor = None, q_seqlens: Tensor = None, kv_start_loc: Tensor = None,
                           kv_seqlens: Tensor = None, alibi_slopes: Tensor = None, sinks: Tensor = None,
                           block_sparse_size: int = 1, kv_layout: str = 'hsd') -> Tensor:
    """Prefill attention over variable-length requests; queries are the last ``q_len`` of each request's keys."""
    _plain(0, 'bshd', alibi_slopes=alibi_slopes, sinks=sinks)
    if block_sparse_size != 1:
        raise NotImplementedError('the CPU attention has no block-sparse prefill')
    if kv_layout == 'hsd':
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    elif kv_layout != 'shd':
        raise NotImplementedError(f'kv layout {kv_layout}')
    if cu_seqlens_q is not None:
        q_starts, q_lens = cu_seqlens_q[:-1].tolist(), cu_seqlens_q.diff().tolist()
    else:
        q_starts, q_lens = q_start_loc.tolist(), q_seqlens.tolist()
    if cu_seqlens_k is not None:
        k_starts, k_lens = cu_seqlens_k[:-1].tolist(), cu_seqlens_k.diff().tolist()
    else:
        k_starts, k_lens = kv_start_loc.tolist(), kv_seqlens.tolist()
    scale = softmax_scale if softmax_scale is not None else q.size(-1)**-0.5
    window = _window(window_size)
    out = q.new_empty(*q.shape[:-1], v.size(-1))
    for qs, ql, ks, kl in zip(q_starts, q_lens, k_starts, k_lens):
        if ql == 0:
            continue
        q_pos = torch.arange(kl - ql, kl) if causal else torch.full((ql, ), kl - 1)
        out[qs:qs + ql] = _attend(q[qs:qs + ql], k[ks:ks + kl], v[ks:ks + kl], q_pos, scale, softcap, window,
                                  True).to(out.dtype)
    return out


def fused_moe(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, topk: int,
              w1_bias: Tensor = None, w2_bias: Tensor = None, expert_offset: int = 0, num_experts: int = None,
              renormalize: bool = False, act_func: Callable | None = None) -> Tensor:
    """Mixture of experts: ``w1 [E, 2I, H]`` gate+up, ``w2 [E, H, I]`` down, ``silu(gate) * up`` by default."""
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    out = torch.zeros(hidden_states.size(0), w2.size(1), dtype=torch.float32)
    local = topk_ids - expert_offset
    for expert in range(w1.size(0)):
        token, slot = torch.nonzero(local == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        x = hidden_states[token]
        h = torch.nn.functional.linear(x, w1[expert], None if w1_bias is None else w1_bias[expert])
        if act_func is None:
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = act_func(h)
        y = torch.nn.functional.linear(h, w2[expert], None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    return out.to(hidden_states.dtype)


# -- the rejection sampler's kernels (lmdeploy/pytorch/spec_decode/reject_sampler.py) -----------------------------
#
# ``rejection_sample`` launches three Triton kernels as ``kernel[grid](...)``. Under the interpreter the recovered-
# token kernel walks the whole vocabulary in Python blocks for every drafted position (seconds per step at 128k);
# these torch functions compute the same outputs from the same inputs, and :class:`TorchLaunch` lets them be
# launched the same way.


class TorchLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` calls a torch function.

    ``replaced`` keeps the kernel it stands in for (the equivalence tests launch both).
    """

    def __init__(self, fn: Callable, replaced=None):
        self.fn = fn
        self.replaced = replaced

    def __getitem__(self, grid) -> Callable:
        return self.fn


def _rows(is_greedy: Tensor | None, batch: int, greedy: bool) -> Tensor:
    """The rows a kernel handles: without a per-row flag, all of them (the kernels' ``is_greedy_ptr is None``)."""
    if is_greedy is None:
        return torch.ones(batch, dtype=torch.bool)
    if is_greedy.shape != (batch, ):
        # the Triton kernels index the flag by request (grid (batch,)) and would silently read the flags of other
        # rows: refuse what they would misread
        raise ValueError(f'rejection sampling got is_greedy of shape {tuple(is_greedy.shape)} for {batch} requests; '
                         'it needs one flag per request (sampling inputs of the requests, not of their draft '
                         'positions)')
    return is_greedy.bool() if greedy else ~is_greedy.bool()


def rejection_greedy_sample(output_token_ids: Tensor, draft_token_ids: Tensor, target_argmax: Tensor,
                            bonus_token_ids: Tensor, is_greedy: Tensor | None, num_spec_tokens: int) -> None:
    """Greedy rows: the target's argmax up to and including the first mismatch with the draft; the bonus token if
    every draft token matched."""
    rows = _rows(is_greedy, draft_token_ids.size(0), greedy=True)
    match = draft_token_ids == target_argmax
    # positions up to the first mismatch (inclusive) are written
    written = torch.cumprod(match.long(), dim=1).roll(1, dims=1)
    written[:, 0] = 1
    written = written.bool() & rows[:, None]
    output_token_ids[:, :num_spec_tokens] = torch.where(written, target_argmax, output_token_ids[:, :num_spec_tokens])
    all_match = match.all(dim=1) & rows
    output_token_ids[all_match, num_spec_tokens] = bonus_token_ids.flatten()[all_match]


def rejection_random_sample(output_token_ids: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
                            target_probs: Tensor, bonus_token_ids: Tensor, recovered_token_ids: Tensor,
                            uniform_probs: Tensor, is_greedy: Tensor | None, num_spec_tokens: int, vocab_size: int,
                            NO_DRAFT_PROBS: bool = True) -> None:  # noqa: N803 (the kernel's keyword)
    """Random rows: accept draft token ``d`` while ``p_target(d) / p_draft(d) >= u``; the first rejected position
    takes the recovered token; the bonus token follows a fully accepted window."""
    rows = _rows(is_greedy, draft_token_ids.size(0), greedy=False)
    index = draft_token_ids.unsqueeze(-1)
    target_prob = target_probs.gather(-1, index).squeeze(-1)
    draft_prob = torch.ones_like(target_prob) if NO_DRAFT_PROBS else draft_probs.gather(-1, index).squeeze(-1)
    accept = (draft_prob > 0) & (target_prob.double() / draft_prob.double() >= uniform_probs)
    before = torch.cumprod(accept.long(), dim=1).roll(1, dims=1)
    before[:, 0] = 1
    written = before.bool() & rows[:, None]
    tokens = torch.where(accept, draft_token_ids, recovered_token_ids)
    output_token_ids[:, :num_spec_tokens] = torch.where(written, tokens, output_token_ids[:, :num_spec_tokens])
    all_accepted = accept.all(dim=1) & rows
    output_token_ids[all_accepted, num_spec_tokens] = bonus_token_ids.flatten()[all_accepted]


def sample_recovered_tokens(output_token_ids: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
                            target_probs: Tensor, inv_q: Tensor, num_spec_tokens: int, vocab_size: int,
                            BLOCK_SIZE: int = 0, NO_DRAFT_PROBS: bool = True) -> None:  # noqa: N803
    """Recovered token of every drafted position by the Gumbel-max trick: ``argmax(prob * inv_q)`` where ``prob`` is
    the target distribution without the draft token (or ``max(p_target - p_draft, 0)`` with draft probabilities)."""
    if NO_DRAFT_PROBS:
        prob = target_probs.scatter(-1, draft_token_ids.unsqueeze(-1), 0.0)
    else:
        prob = (target_probs - draft_probs).clamp_min(0.0)
    output_token_ids.copy_((prob * inv_q[:, None, :]).argmax(dim=-1))
