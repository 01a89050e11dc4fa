"""The shell and Python examples of README.md, docs/ (English and Simplified Chinese) and examples/README.md, run as
a user runs them.

Sybil finds the ```` ```bash ```` and ```` ```python ```` blocks (pytest marker ``docs``); every other fence is
output or data. Each block runs in a fresh process from the repository root with ``.venv/bin`` first on ``PATH``
(an activated virtual environment): bash with ``-e -o pipefail``, Python as a script. A block that cannot run here
carries ``<!-- skip: next "reason" -->`` and shows up as skipped with that reason. A block whose code, comments
left out, equals one already run in this session (the same example in both languages, the demo on several pages)
is not run again.

``<!-- docs-test: MODE -->`` before a block changes how the next block runs:

- ``server``: the block starts a server that runs until the examples end (the first test that is not an example
  stops it: an idle server holds 1.5 GB and some CPU, which the end-to-end tests after the examples need); it is
  started in the background and the test waits until ``/v1/models`` answers. The port of ``--server-port`` is
  replaced by a free one, and so is ``localhost:PORT`` in the blocks after it, so that runs on a shared machine do
  not collide;
- ``sandbox``: the block runs on a copy of the installed lmdeploy (its directories, its Python files and the
  series' state copied, links to its other files), found first through ``PYTHONPATH``: ``apply`` and ``revert``
  change the copy. The block does not run unless lmdeploy resolves to the copy.
"""
from __future__ import annotations

import http.client
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
import urllib.request
from pathlib import Path

import pytest
from sybil import Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

from lmdeploy_guided_spec.testing import forget_at_exit, free_port, kill_at_exit

ROOT = Path(__file__).parent
#: The most one example may take (the demo builds SmolLM2 on a fresh machine).
EXAMPLE_TIMEOUT_S = 600
SERVER_STARTUP_S = 300


_WHERE_IS_LMDEPLOY = ('import importlib.util, pathlib; '
                      'print(pathlib.Path(importlib.util.find_spec("lmdeploy").origin).resolve())')


def _without_comments(kind: str, source: str) -> str:
    """The code of an example without its comments: examples that differ only there (the languages) run once."""
    if kind == 'python':
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type != tokenize.COMMENT]
        return tokenize.untokenize((t.type, t.string) for t in tokens)
    return '\n'.join(line for line in source.splitlines() if not line.lstrip().startswith('#'))


class DocsRunner:
    """Runs the examples; remembers results, servers and port changes for the session."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.results: dict[tuple[str, str], str | None] = {}
        self.ports: dict[int, int] = {}
        self.servers: list[tuple[subprocess.Popen, Path]] = []
        self.env = {**os.environ, 'PATH': f'{Path(sys.executable).parent}{os.pathsep}{os.environ.get("PATH", "")}'}

    def run(self, kind: str, source: str, mode: str | None) -> None:
        key = (f'{kind}:{mode}', _without_comments(kind, source))
        if key not in self.results:
            self.results[key] = self._run(kind, self._with_ports(source), mode)
        if self.results[key] is not None:
            pytest.fail(self.results[key], pytrace=False)

    def _with_ports(self, source: str) -> str:
        for documented, used in self.ports.items():
            source = source.replace(f'localhost:{documented}', f'localhost:{used}')
        return source

    def _run(self, kind: str, source: str, mode: str | None) -> str | None:
        if mode == 'server':
            return self._start_server(source)
        env = dict(self.env)
        if mode == 'sandbox':
            site = self._sandbox()
            env['PYTHONPATH'] = str(site)
            probe = subprocess.run([sys.executable, '-c', _WHERE_IS_LMDEPLOY], env=env, capture_output=True, text=True)
            if site not in Path(probe.stdout.strip()).parents:
                return f'lmdeploy does not resolve to the sandbox {site}: {probe.stdout}{probe.stderr}'
        if kind == 'python':
            script = self.tmp / f'example{len(self.results)}.py'
            script.write_text(source)
            cmd = [sys.executable, str(script)]
        else:
            cmd = ['bash', '-e', '-o', 'pipefail', '-c', source]
        try:
            result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f'the example did not finish in {EXAMPLE_TIMEOUT_S} s'
        if result.returncode != 0:
            return (f'exit code {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n'
                    f'--- stderr\n{result.stderr[-3000:]}')
        return None

    def _start_server(self, source: str) -> str | None:
        found = re.search(r'--server-port (\d+)', source)
        documented = int(found.group(1)) if found else 23333
        port = free_port()
        self.ports[documented] = port
        source = (source.replace(found.group(0), f'--server-port {port}') if found
                  else f'{source.rstrip()} --server-port {port}')
        log = self.tmp / f'server{port}.log'
        with log.open('wb') as out:
            proc = subprocess.Popen(['bash', '-c', source], cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append((proc, log))
        # a terminated test run (a CI time limit) still stops the servers, with their engine processes
        kill_at_exit(proc)
        deadline = time.monotonic() + SERVER_STARTUP_S
        while True:
            if proc.poll() is not None:
                return f'the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}'
            try:
                urllib.request.urlopen(f'http://127.0.0.1:{port}/v1/models', timeout=2)
                return None
            except (OSError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    return f'the server did not answer in {SERVER_STARTUP_S} s:\n{log.read_text()[-4000:]}'
                time.sleep(1)

    def _sandbox(self) -> Path:
        """A copy of the installed lmdeploy: directories, Python files and the series' state; links to the rest."""
        import importlib.util
        site = self.tmp / f'site{len(self.results)}'
        package = Path(importlib.util.find_spec('lmdeploy').origin).parent
        for top in [package, *package.parent.glob('lmdeploy-*.dist-info')]:
            for dirpath, dirnames, filenames in os.walk(top):
                here = site / Path(dirpath).relative_to(package.parent)
                here.mkdir(parents=True, exist_ok=True)
                if Path(dirpath).name == '.guided_spec':
                    shutil.copytree(dirpath, here, dirs_exist_ok=True)
                    dirnames[:] = []
                    continue
                for name in filenames:
                    source = Path(dirpath) / name
                    if name.endswith('.py') or top.name.endswith('.dist-info'):
                        # the patcher finds the package by the resolved path of __init__.py, and patches .py files
                        shutil.copy2(source, here / name)
                    else:
                        (here / name).symlink_to(source)
        return site

    def close(self) -> None:
        """Stop the servers with their engine processes (each server leads its own process group). A server example
        run again after this starts its server again."""
        running = [proc for proc, _ in self.servers if proc.poll() is None]
        for proc in running:
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(proc.poll() is None for proc in running) and time.monotonic() < deadline:
            time.sleep(0.5)
        for proc in running:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for proc, _ in self.servers:
            forget_at_exit(proc)
        self.servers.clear()
        self.ports.clear()
        for key in [key for key in self.results if key[0].endswith(':server')]:
            del self.results[key]


#: the session's runner, while it lives
_runner: DocsRunner | None = None


@pytest.fixture(scope='session')
def docs_runner():
    global _runner
    with tempfile.TemporaryDirectory(prefix='docs-examples-') as tmp:
        _runner = DocsRunner(Path(tmp))
        try:
            yield _runner
        finally:
            _runner.close()
            _runner = None


def pytest_runtest_setup(item):
    # the examples run together (tests/e2e/conftest.py puts the end-to-end tests after every other test): the first
    # test that is not an example stops the servers they started
    if _runner is not None and _runner.servers and Path(str(item.fspath)).suffix != '.md':
        _runner.close()


def _mode(example) -> str | None:
    return example.document.namespace.pop('docs-test mode', None)


def _evaluate_directive(example) -> None:
    example.document.namespace['docs-test mode'] = example.parsed.strip()


def _parse_directives(document):
    for lexed in DirectiveInHTMLCommentLexer(directive='docs-test', arguments='[a-z-]+')(document):
        yield Region(lexed.start, lexed.end, lexed.lexemes['arguments'], _evaluate_directive)


def _evaluator(kind: str):
    def evaluate(example) -> None:
        example.namespace['docs_runner'].run(kind, str(example.parsed), _mode(example))
    return evaluate


pytest_collect_file = Sybil(
    parsers=[SkipParser(), _parse_directives, CodeBlockParser('bash', _evaluator('bash')),
             CodeBlockParser('python', _evaluator('python'))],
    patterns=['README.md', 'docs/*/*.md', 'examples/README.md'],
    fixtures=['docs_runner'],
).pytest()


def pytest_addoption(parser):  # the one_method mark of tests/conftest.py
    parser.addoption('--every-method', action='store_true',
                     help='run every speculative method of the tests marked one_method, not only those their mark '
                          'names for the lmdeploy release installed')


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == '.md':
            item.add_marker(pytest.mark.docs)
