"""The core library never imports lmdeploy; the command-line tool starts without torch."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lmdeploy_guided_spec

pytestmark = pytest.mark.unit

CORE = Path(lmdeploy_guided_spec.__file__).parent


def test_core_sources_do_not_import_lmdeploy():
    for path in CORE.glob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or '']
            assert not any(n == 'lmdeploy' or n.startswith('lmdeploy.') for n in names), f'{path.name} imports {names}'


def test_importing_the_core_loads_no_lmdeploy():
    code = ('import sys, lmdeploy_guided_spec as g; from lmdeploy_guided_spec import testing; '
            '[getattr(g, n) for n in g.__all__]; '
            'bad = [m for m in sys.modules if m == "lmdeploy" or m.startswith("lmdeploy.")]; '
            'assert not bad, bad')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_cli_starts_without_torch():
    code = ('import sys; from lmdeploy_guided_spec.tools import cli; '
            'assert "torch" not in sys.modules and "xgrammar" not in sys.modules')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_public_names_resolve():
    for name in lmdeploy_guided_spec.__all__:
        assert getattr(lmdeploy_guided_spec, name) is not None
    with pytest.raises(AttributeError):
        lmdeploy_guided_spec.no_such_name  # noqa: B018
