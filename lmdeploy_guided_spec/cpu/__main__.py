"""``python -m lmdeploy_guided_spec.cpu``: the CPU path from the command line.

Commands:

- ``serve MODEL [ARGS...]``: ``lmdeploy serve api_server MODEL ARGS...`` on the CPU. ``MODEL`` and the value of
  ``--speculative-draft-model`` may be model names (``models`` lists them). The lmdeploy command runs in this
  process with ``LMDEPLOY_GUIDED_SPEC_DEVICE=cpu``; the engine process it spawns activates the CPU path through
  the ``.pth`` hook, which is installed first when missing.
- ``models [NAME...]``: build (on first use) and print the named models.
- ``install-hook`` / ``uninstall-hook``: the ``.pth`` hook in this environment's site-packages.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import ENV, hook, models

__all__ = ['main', 'serve']


def serve(argv: Sequence[str]) -> int:
    """Run ``lmdeploy serve api_server`` with ``argv`` on the CPU (resolving model names); returns its status."""
    import os
    argv = list(argv)
    if not argv or argv[0].startswith('-'):
        print('usage: serve MODEL [lmdeploy serve api_server options]', file=sys.stderr)
        return 2
    argv[0] = models.resolve(argv[0])
    for i, arg in enumerate(argv[:-1]):
        if arg == '--speculative-draft-model':
            argv[i + 1] = models.resolve(argv[i + 1])
    if not hook.is_installed():
        print(f'installing the CPU hook for child processes: {hook.install()}', file=sys.stderr)
    os.environ[ENV] = 'cpu'
    from . import activate
    activate()
    from lmdeploy.cli import run
    sys.argv = ['lmdeploy', 'serve', 'api_server', *argv]
    return int(run() or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m lmdeploy_guided_spec.cpu',
                                     description="lmdeploy's PyTorch engine on the CPU")
    sub = parser.add_subparsers(dest='command', required=True)
    p = sub.add_parser('serve', help='lmdeploy serve api_server on the CPU', add_help=False)
    p.add_argument('args', nargs=argparse.REMAINDER)
    p = sub.add_parser('models', help='build and print the named models')
    p.add_argument('names', nargs='*', metavar='NAME', help=f'default: all of {", ".join(models.MODELS)}')
    sub.add_parser('install-hook', help='install the .pth hook that activates the CPU path in child processes')
    sub.add_parser('uninstall-hook', help='remove the .pth hook')
    args = parser.parse_args(argv)
    if args.command == 'serve':
        return serve(args.args)
    if args.command == 'models':
        unknown = [n for n in args.names if not models.is_name(n)]
        if unknown:
            parser.error(f'unknown model(s) {", ".join(unknown)}; known: {", ".join(models.MODELS)}')
        for name in args.names or models.MODELS:
            print(f'{name}: {models.resolve(name)}', flush=True)
        return 0
    if args.command == 'install-hook':
        print(hook.install())
        return 0
    print('removed' if hook.uninstall() else 'not installed')
    return 0


if __name__ == '__main__':
    sys.exit(main())
