"""The layers of the package: the core imports no lmdeploy and none of the parts beside it; the series tooling imports
neither the CPU path nor the test support nor the command line; the CPU path and the test support never import the
command line; the command-line tool starts without torch."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lmdeploy_guided_spec

pytestmark = pytest.mark.unit

CORE = Path(lmdeploy_guided_spec.__file__).parent
PACKAGE = 'lmdeploy_guided_spec'
#: The subpackages beside the core, each with the subpackages it must not import (the core may import none).
LAYERS = {
    'series': ('cpu', 'support', 'cli'),
    'cpu': ('cli', 'series'),
    'support': ('cli', 'series'),
    'cli': (),
}


def _imports(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports, at any depth (imports inside functions too)."""
    module = '.'.join(path.relative_to(CORE.parent).with_suffix('').parts)
    package = module if path.name == '__init__.py' else module.rpartition('.')[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')
                base = '.'.join(base[:len(base) - node.level + 1])
                base = f'{base}.{node.module}' if node.module else base
            else:
                base = node.module or ''
            names.append(base)
            names.extend(f'{base}.{a.name}' for a in node.names)
    return names


def _layer(name: str) -> str | None:
    parts = name.split('.')
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else 'core'


def test_core_sources_do_not_import_lmdeploy():
    for path in CORE.glob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or '']
            assert not any(n == 'lmdeploy' or n.startswith('lmdeploy.') for n in names), f'{path.name} imports {names}'


def test_the_core_imports_none_of_the_parts_beside_it():
    for path in CORE.glob('*.py'):
        bad = [n for n in _imports(path) if _layer(n) not in (None, 'core')]
        assert not bad, f'{path.name} imports {bad}'


def test_the_subpackages_are_the_known_layers():
    found = {p.parent.name for p in CORE.glob('*/__init__.py')}
    assert found == set(LAYERS), 'a new subpackage needs its place in LAYERS'


@pytest.mark.parametrize('layer', sorted(LAYERS))
def test_no_layer_imports_one_it_must_not(layer: str):
    for path in sorted((CORE / layer).rglob('*.py')):
        bad = [n for n in _imports(path) if _layer(n) in LAYERS[layer]]
        assert not bad, f'{path.relative_to(CORE)} imports {bad}'


def test_the_series_tooling_imports_no_torch_xgrammar_or_lmdeploy():
    for path in sorted((CORE / 'series').rglob('*.py')):
        bad = [n for n in _imports(path) if n.split('.')[0] in ('torch', 'xgrammar', 'lmdeploy')]
        assert not bad, f'{path.relative_to(CORE)} imports {bad}'


def test_importing_the_core_loads_no_lmdeploy():
    code = ('import sys, lmdeploy_guided_spec as g; from lmdeploy_guided_spec import testing; '
            '[getattr(g, n) for n in g.__all__]; '
            'bad = [m for m in sys.modules if m == "lmdeploy" or m.startswith("lmdeploy.")]; '
            'assert not bad, bad')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_cli_starts_without_torch():
    code = ('import sys; from lmdeploy_guided_spec import cli; '
            'assert "torch" not in sys.modules and "xgrammar" not in sys.modules')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_public_names_resolve():
    for name in lmdeploy_guided_spec.__all__:
        assert getattr(lmdeploy_guided_spec, name) is not None
    with pytest.raises(AttributeError):
        lmdeploy_guided_spec.no_such_name  # noqa: B018


def _runs_no_lmdeploy(name: str) -> bool:
    """Whether importing ``name`` (from a test) loads no lmdeploy code: it is not lmdeploy, and of this package it is
    the core or a support module whose own imports are the core's or outside lmdeploy."""
    if name.split('.')[0] == 'lmdeploy':
        return False
    if _layer(name) in (None, 'core'):
        return True
    source = CORE.parent / f'{name.replace(".", "/")}.py'
    if _layer(name) != 'support' or not source.is_file():
        return _layer(name) == 'support'  # the support package or a name inside a module, checked as that module
    return all(n.split('.')[0] != 'lmdeploy' and _layer(n) in (None, 'core', 'support') for n in _imports(source))


def test_the_tests_that_balance_the_two_releases_runs_are_the_cores_own_or_named_checks():
    """scripts/test.sh runs the tests of tests/balance-0.14.0.txt once, against 0.14.0 when both releases' venvs
    exist: a unit test there must run no lmdeploy code, and every line must name a test file, or a test in one, that
    exists."""
    root = Path(__file__).parents[2]
    lines = [line.strip() for line in (root / 'tests' / 'balance-0.14.0.txt').read_text().splitlines()]
    entries = [line for line in lines if line and not line.startswith('#')]
    assert entries
    for entry in entries:
        path, _, name = entry.partition('::')
        source = root / path
        assert source.is_file(), f'{entry}: no such test file'
        tree = ast.parse(source.read_text())
        if name:
            assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f'{entry}: no such test'
        if path.startswith('tests/unit/'):
            names = []
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.extend(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names.append(node.module or '')
                    names.extend(f'{node.module}.{a.name}' for a in node.names)
            bad = [n for n in names if not _runs_no_lmdeploy(n)]
            assert not bad, f'{entry} imports {bad}'
