"""Activation of the CPU path in every Python process lmdeploy starts.

lmdeploy's api_server runs its engine in a process started with ``multiprocessing``'s *spawn* method (the ZMQ
engine), which imports lmdeploy afresh. A ``.pth`` file in the environment's site-packages reaches it: at
interpreter start it checks ``LMDEPLOY_GUIDED_SPEC_DEVICE`` and, only when it is ``cpu``, arranges for
:func:`lmdeploy_guided_spec.cpu.activate` to run as soon as the ``lmdeploy`` package has been imported (before any
engine is built). Processes without the variable pay one environment lookup.

Only ``scripts/setup.sh`` and the explicit ``python -m lmdeploy_guided_spec.cpu install-hook`` write the file;
``serve-cpu`` refuses to start without it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from . import ENV

__all__ = ['PTH_NAME', 'pth_path', 'pth_line', 'install', 'uninstall', 'is_installed', 'on_startup']

PTH_NAME = 'lmdeploy_guided_spec_cpu.pth'


def pth_line() -> str:
    """The single line of the ``.pth`` file (``site`` executes lines that start with ``import``)."""
    return (f"import os; os.environ.get('{ENV}') == 'cpu' and "
            "__import__('lmdeploy_guided_spec.cpu.hook').cpu.hook.on_startup()\n")


def pth_path(site_dir: Path | None = None) -> Path:
    """Where the ``.pth`` file lives: ``site_dir`` or this interpreter's purelib directory."""
    return Path(site_dir or sysconfig.get_paths()['purelib']) / PTH_NAME


def is_installed(site_dir: Path | None = None) -> bool:
    """Whether the hook is installed with the current line."""
    path = pth_path(site_dir)
    return path.is_file() and path.read_text() == pth_line()


def install(site_dir: Path | None = None) -> Path:
    """Write the ``.pth`` file (idempotent) and return its path."""
    path = pth_path(site_dir)
    if not is_installed(site_dir):
        path.write_text(pth_line())
    return path


def uninstall(site_dir: Path | None = None) -> bool:
    """Remove the ``.pth`` file; ``True`` when there was one."""
    path = pth_path(site_dir)
    if path.is_file():
        path.unlink()
        return True
    return False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after the module ``name`` has been executed."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        callback = self.callback

        def exec_then_activate(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_activate
        return spec


def on_startup() -> None:
    """Called by the ``.pth`` line when ``LMDEPLOY_GUIDED_SPEC_DEVICE=cpu``: activate once lmdeploy is imported."""
    from . import activate
    if 'lmdeploy' in sys.modules:
        activate()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport('lmdeploy', activate))
