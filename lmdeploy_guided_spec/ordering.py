"""Ordering between device work and the host: reads of device token ids on the worker, copies to the device.

lmdeploy runs its loop under ``torch.cuda.stream(...)``, and the current stream is per thread: the grammar worker
thread reads on a stream of its own, which nothing orders after the kernel that wrote the ids. So the engine
records an event on the producing stream right after the ids are written (:func:`record_ready`) and hands it to
the core as ``ready``; the worker waits for it (:func:`host_lists`) before its first host read.

In the other direction, small index and value tensors built on the engine thread are staged in page-locked memory
and copied without blocking the host (:func:`to_device`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ['Ready', 'record_ready', 'host_lists', 'to_device', 'PromptIds']


class Ready(Protocol):
    """What ``ready`` arguments are: a ``torch.cuda.Event`` recorded after the ids were written, or alike."""

    def synchronize(self) -> None:
        """Block the calling thread until the work recorded before the event is done."""


def record_ready(tensor) -> torch.cuda.Event | None:
    """An event recorded on the current stream after the work that writes ``tensor``; None unless on CUDA.

    Call it on the thread and stream that launched the kernel writing ``tensor``, right after the launch, and pass
    the result as ``ready`` to the core call that takes ``tensor``. For CPU tensors (and lists) there is nothing to
    order, and ``ready=None`` is what the core expects.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != 'cuda':
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def host_lists(token_ids, ready: Ready | None = None) -> list:
    """Token ids as nested Python lists, read after ``ready`` (one device-to-host copy for a tensor).

    ``token_ids`` is a tensor ``(rows,)`` / ``(rows, n)`` or a sequence of ints or of int sequences; inner
    tuples become lists.
    """
    if ready is not None:
        ready.synchronize()
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return [list(r) if isinstance(r, (list, tuple)) else r for r in token_ids]


class PromptIds(Sequence):
    """The prompt token ids of each row of a prefill, read on the thread that uses them.

    ``input_ids`` holds the rows' tokens one after the other (lmdeploy's ``(1, total)`` prefill layout) and
    ``seq_length`` the number of tokens per row, both possibly on a device. Construct it on the thread that launched
    their copies (it records ``ready`` there, :func:`record_ready`); the first ``len()`` or row read waits for it,
    so the engine thread never waits for a device-to-host copy.
    """

    def __init__(self, input_ids: torch.Tensor, seq_length: torch.Tensor, ready: Ready | None = None):
        self._input_ids = input_ids
        self._seq_length = seq_length
        self._ready = ready if ready is not None else record_ready(input_ids)
        self._rows: list[list[int]] | None = None

    def _load(self) -> list[list[int]]:
        if self._rows is None:
            flat = host_lists(self._input_ids.reshape(-1), self._ready)
            rows, start = [], 0
            for length in host_lists(self._seq_length.reshape(-1)):
                rows.append(flat[start:start + length])
                start += length
            self._rows = rows
        return self._rows

    def __len__(self) -> int:
        return len(self._load())

    def __getitem__(self, row):
        return self._load()[row]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` as a tensor on ``device``; for a CUDA device staged in page-locked memory and copied without
    blocking the host (a plain ``torch.tensor(values, device='cuda')`` waits for its copy)."""
    device = torch.device(device)
    if device.type != 'cuda':
        return torch.tensor(values, dtype=dtype, device=device)
    # the caching host allocator keeps the staging block until the copy that reads it has run
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
