"""A fork server for the grammar compiler processes: one interpreter per process that imports xgrammar once and forks
each compiler process from itself, in milliseconds, instead of a fresh interpreter that spends seconds importing
xgrammar (and torch and transformers with it) for every process.

The serving process never forks (it holds CUDA and threads): the fork server is a plain interpreter started once,
by a thread of its own that lives as long as it does (Linux's ``PR_SET_PDEATHSIG`` acts when the *thread* that
started a process ends). The fork server ends with the process it serves, and its children end with it, so a
killed engine leaves none of them behind. It forks on request only, with the compiler process's socket handed over
the control socket (``SCM_RIGHTS``); it sends back a pidfd of each child, so the serving process kills a child
without the risk of a reused pid, and the exit status of each, since only a parent can reap a child.

Not multiprocessing's ``forkserver``: its children import the parent's ``__main__`` again (a user's script without
a main guard would run again), and it is one per process for every use of multiprocessing.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

__all__ = ['ForkServer', 'ForkedProcess', 'fork_server', 'end_with_parent', 'start_interpreter']

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# the fork server's code: a plain interpreter, which imports ``preload`` (argv[3]) and forks from it
_SERVER_CODE = ('import sys; from lmdeploy_guided_spec.forkserver import _serve; '
                '_serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])')

# a start imports the preloaded module (xgrammar: seconds on a loaded machine); only a guard against a fork server
# that never comes up
_STARTUP_TIMEOUT_S = 120.0
# a fork is milliseconds; a guard against a fork server that stopped answering
_FORK_TIMEOUT_S = 60.0
_MESSAGE_BYTES = 4096


def end_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux's ``PR_SET_PDEATHSIG``). A parent that dies
    (the OOM killer, a crash, ``kill -9``) closes the sockets, but a child inside a compile reads its socket only
    when the compile ends, which can be minutes, holding its memory all along. Unlike a watching thread this works
    while xgrammar holds the GIL. (The kernel acts when the parent's *thread* that started the child ends.)"""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):  # not Linux: the socket's EOF after the compile ends the child
        return
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning('a grammar compiler process cannot end with its parent (prctl: %s); after an engine '
                       'death it ends when its compile does', os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != parent_pid:  # the parent died before the call
        os._exit(0)


_supported: bool | None = None
# set where a fork server did not start (its import failed or hung): this process starts fresh interpreters
_disabled = False


def start_interpreter(code: str, fd: int, *args: object) -> subprocess.Popen:
    """A plain interpreter that runs ``code`` with ``fd`` (passed to it) and ``args`` as its arguments, and imports
    this package from wherever this process found it."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.Popen([sys.executable, '-c', code, str(fd), *map(str, args)], pass_fds=(fd,),
                            stdin=subprocess.DEVNULL, env=env, close_fds=True)


def supported() -> bool:
    """Whether this platform has what the fork server needs: pidfds (Linux 5.3; a sandbox's seccomp profile may
    refuse them) and passing descriptors."""
    global _supported
    if _supported is None:
        _supported = (sys.platform == 'linux' and hasattr(os, 'pidfd_open') and hasattr(signal, 'pidfd_send_signal')
                      and hasattr(socket, 'send_fds') and hasattr(socket, 'SOCK_SEQPACKET')
                      and hasattr(socket, 'MSG_CMSG_CLOEXEC'))
        if _supported:
            try:
                os.close(os.pidfd_open(os.getpid()))
            except OSError:
                _supported = False
    return _supported


#: The exit code of a child that ended without the fork server's report of it (the fork server died with it).
UNKNOWN_EXIT = -1
# seconds an ended child's exit code may take to arrive (the fork server reaps it at once)
_REPORT_WAIT_S = 5.0


class ForkedProcess:
    """A child of a fork server, as much of ``subprocess.Popen`` as the compile service uses: ``pid``, ``poll``,
    ``kill``, ``wait`` and ``returncode`` (the exit code, or minus the signal that ended it; :data:`UNKNOWN_EXIT`
    where the fork server did not report it). In a fork of the serving process it is another process's child, and
    ended to it, as ``Popen`` says of a child that is not its own: it is never signalled from there."""

    def __init__(self, pid: int, pidfd: int):
        self.pid = pid
        self._pidfd = pidfd
        self._owner = os.getpid()
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        if os.getpid() != self._owner:
            return 0
        with self._lock:
            ended = self.returncode is None and self._pidfd >= 0 and _readable(self._pidfd)
        if ended:
            # a pidfd turns readable when its process ends: the fork server's report of the exit code follows (it
            # never does once the interpreter is finalizing: its thread runs no more)
            if sys.is_finalizing() or not self._ended.wait(_REPORT_WAIT_S):
                self._end(UNKNOWN_EXIT)
        return self.returncode

    def kill(self) -> None:
        if os.getpid() != self._owner:
            return
        with self._lock:
            if self._pidfd < 0:  # reaped: nothing to signal
                return
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        if os.getpid() != self._owner:
            return 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended.wait(_REPORT_WAIT_S if deadline is None else
                                   max(0.0, min(_REPORT_WAIT_S, deadline - time.monotonic()))):
            if self.poll() is not None:  # ended, its report lost
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f'grammar compiler process {self.pid}', timeout)
        return self.returncode

    def _end(self, code: int) -> None:
        with self._lock:
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
            if self.returncode is None:
                self.returncode = code
        self._ended.set()

    def __del__(self):
        with contextlib.suppress(Exception):
            if self._pidfd >= 0:
                os.close(self._pidfd)


def _readable(fd: int) -> bool:
    """Whether ``fd`` is readable now (``poll``: ``select`` refuses descriptors from 1024 on, which a server with many
    connections hands out)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class ForkServer:
    """A fork server that imported ``preload`` (a module name), started at once by a thread of its own.

    :meth:`fork` starts a child that runs ``target(fd, *args)`` (``target`` a ``'module:function'`` of the preloaded
    module's world) with ``fd`` its end of a socket the caller made, and returns it as a :class:`ForkedProcess`.
    A fork server that died is :attr:`dead`: its children died with it, and :func:`fork_server` starts another.
    """

    def __init__(self, preload: str):
        self.preload = preload
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._replies: queue.Queue = queue.Queue()
        self._fork_lock = threading.Lock()
        self._children: dict[int, ForkedProcess] = {}
        self._children_lock = threading.Lock()
        self.dead = False
        self._ready = False
        self.process: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, args=(theirs,), name='guided-spec-fork-server',
                                        daemon=True)
        self._thread.start()

    def fork(self, target: str, fd: int, *args: int) -> ForkedProcess:
        """Fork a child that runs ``target(fd, *args)``; ``OSError`` where the fork server cannot (it did not start,
        died, or the fork failed). The caller keeps its own copy of ``fd`` and closes it."""
        with self._fork_lock:
            if not self._ready:
                first = self._reply(_STARTUP_TIMEOUT_S)
                if first[0] != 'ready':
                    global _disabled
                    _disabled = True  # (a failed import fails again: each start would cost it again)
                    self.dead = True
                    self.close()
                    raise OSError(f'the fork server did not start ({first[1]}); this process starts fresh '
                                  f'interpreters from now on')
                self._ready = True
            if self.dead:
                raise OSError('the fork server died')
            # MSG_NOSIGNAL: a fork server gone is an OSError here, never a SIGPIPE that a host script left fatal
            socket.send_fds(self._sock, [json.dumps(['fork', target, list(args)]).encode()], [fd],
                            socket.MSG_NOSIGNAL)
            reply = self._reply(_FORK_TIMEOUT_S)
            if reply[0] != 'forked':
                raise OSError(f'the fork server could not fork: {reply[1]}')
            return reply[1]

    def close(self) -> None:
        """Stop the fork server (its children end with it)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self.process is not None:
            with contextlib.suppress(OSError):
                self.process.kill()

    def _reply(self, timeout: float):
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            self.dead = True
            self.close()
            return ('error', f'no answer within {timeout:g} s')

    def _run(self, theirs: socket.socket) -> None:
        """The fork server's whole life, on one thread: start it (its parent thread is this one, so it ends with this
        process, not with a thread that came and went), then pass on its answers and the exit codes of its
        children until it ends."""
        try:
            try:
                self.process = start_interpreter(_SERVER_CODE, theirs.fileno(), os.getpid(), self.preload)
            finally:
                theirs.close()
        except OSError as exc:
            self.dead = True
            self._replies.put(('error', str(exc)))
            return
        try:
            while True:
                try:
                    # close-on-exec: a pidfd must not leak into a program the serving process runs
                    data, fds, _, _ = socket.recv_fds(self._sock, _MESSAGE_BYTES, 1, socket.MSG_CMSG_CLOEXEC)
                except OSError:
                    data, fds = b'', []
                if not data:
                    break
                message = json.loads(data)
                if message[0] == 'forked' and not fds:
                    # no descriptor left to receive it in (the fd limit): the child ends when the caller's end of its
                    # socket closes with the failed start
                    self._replies.put(('error', 'no descriptor for the pidfd of the child'))
                elif message[0] == 'forked':
                    child = ForkedProcess(message[1], fds[0])
                    with self._children_lock:
                        self._children[child.pid] = child
                    self._replies.put(('forked', child))
                elif message[0] == 'exited':
                    with self._children_lock:
                        child = self._children.pop(message[1], None)
                    if child is not None:
                        child._end(message[2])
                else:  # 'ready', 'error'
                    for fd in fds:
                        os.close(fd)
                    self._replies.put(tuple(message))
        finally:
            # the fork server ended: its children were killed with it (PR_SET_PDEATHSIG), and nobody reaps them here
            self.dead = True
            with self._children_lock:
                children, self._children = list(self._children.values()), {}
            for child in children:
                child._end(-signal.SIGKILL)
            self._replies.put(('error', 'the fork server died'))
            with contextlib.suppress(OSError):  # closed with the object: a fork() may be sending on it right now
                self._sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(Exception):
                self.process.kill()
                self.process.wait(timeout=10)


# the fork servers of this process, by preloaded module, and the pid they belong to: a forked process starts its own
_servers: dict[str, ForkServer] = {}
_servers_pid: int | None = None
_servers_lock = threading.Lock()


def fork_server(preload: str) -> ForkServer | None:
    """This process's fork server that preloaded ``preload``, started on first use and again after it died; None
    where the platform lacks what it needs (:func:`supported`)."""
    global _servers_pid
    if _disabled or not supported():
        return None
    with _servers_lock:
        if _servers_pid != os.getpid():  # a fork of a process that had some: theirs are the parent's
            _servers.clear()
            _servers_pid = os.getpid()
        server = _servers.get(preload)
        if server is None or server.dead:
            server = _servers[preload] = ForkServer(preload)
        return server


def _serve(fd: int, parent_pid: int, preload: str) -> None:
    """Body of the fork server: import ``preload``, then fork on request until the serving process goes away."""
    end_with_parent(parent_pid)
    # Ctrl-C in a terminal (SIGINT) and a service stop (systemd, docker: SIGTERM) reach the whole process group: the
    # fork server and its children end with the serving process (above), not before it (a server shutting down
    # gracefully started fresh interpreters to check the grammars of requests still in flight)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the mask of the thread that started it is inherited: SIGCHLD must arrive to wake the loop below
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    sock = socket.socket(fileno=fd)
    try:
        importlib.import_module(preload)
    except BaseException as exc:  # noqa: BLE001 - said to the serving process, which falls back
        sock.send(json.dumps(['error', f'importing {preload} failed: {type(exc).__name__}: {exc}']).encode())
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below (the wakeup fd)
    sock.send(json.dumps(['ready']).encode())
    me = os.getpid()
    children: set[int] = set()
    try:
        _fork_loop(sock, wake_r, wake_w, me, children)
    finally:
        # the serving process went away: end the children now and reap them (they would end with this process
        # anyway, but nobody might reap them then: a container whose first process does not)
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


def _fork_loop(sock: socket.socket, wake_r: int, wake_w: int, me: int, children: set) -> None:
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        _reap(sock, children)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError:
            return
        if not data:  # the serving process went away
            return
        _, target, args = json.loads(data)
        if not fds:
            sock.send(json.dumps(['error', 'no socket came with the request']).encode())
            continue
        try:
            pid = os.fork()
        except OSError as exc:
            for child_fd in fds:
                os.close(child_fd)
            sock.send(json.dumps(['error', f'fork: {exc}']).encode())
            continue
        if pid == 0:
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                end_with_parent(me)
                module, _, function = target.partition(':')
                getattr(importlib.import_module(module), function)(fds[0], *args)
                code = 0
            except BaseException:  # noqa: BLE001 - the child's end, as an interpreter's would be
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.add(pid)
        for child_fd in fds:  # the child holds its socket alone: its death shows as EOF to the serving process
            os.close(child_fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            os.kill(pid, signal.SIGKILL)
            sock.send(json.dumps(['error', f'pidfd_open: {exc}']).encode())
            continue
        try:
            socket.send_fds(sock, [json.dumps(['forked', pid]).encode()], [pidfd])
        finally:
            os.close(pidfd)


def _reap(sock: socket.socket, children: set) -> None:
    """Reap the children that ended and tell the serving process their exit codes (a send that fails ends the fork
    server: the serving process is gone)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        sock.send(json.dumps(['exited', pid, os.waitstatus_to_exitcode(status)]).encode())
