"""``python -m lmdeploy_guided_spec.cpu``: the CPU path from the command line.

Commands:

- ``serve MODEL [ARGS...]``: ``lmdeploy serve api_server MODEL ARGS...`` on the CPU. ``MODEL`` and the value of
  ``--speculative-draft-model`` may be model names (``models`` lists them). The lmdeploy command runs in this
  process with ``LMDEPLOY_GUIDED_SPEC_DEVICE=cpu``; the engine process it spawns activates the CPU path through
  the ``.pth`` hook, so ``serve`` refuses to start without it (``install-hook``; ``scripts/setup.sh`` runs it).
  ``serve --help`` prints lmdeploy's options.
- ``models [NAME...]``: build (on first use) and print the named models.
- ``install-hook`` / ``uninstall-hook``: the ``.pth`` hook in this environment's site-packages.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import ENV, hook, models

__all__ = ['main', 'serve']


SERVE_USAGE = 'MODEL [lmdeploy serve api_server options]'


def _serve_help(prog: str) -> str:
    names = ', '.join(models.MODELS)
    return (f'usage: {prog} {SERVE_USAGE}\n\n'
            "lmdeploy serve api_server on the CPU path. MODEL is a checkpoint directory or one of the CPU path's "
            f'models ({names}); so may be the value of --speculative-draft-model. The other options are those of '
            'lmdeploy serve api_server, passed on unchanged:\n')


def serve(argv: Sequence[str], prog: str = 'python -m lmdeploy_guided_spec.cpu serve') -> int:
    """Run ``lmdeploy serve api_server`` with ``argv`` on the CPU (resolving model names); returns its status."""
    import os
    argv = list(argv)
    if argv[:1] in (['-h'], ['--help']):
        print(_serve_help(prog), flush=True)
        return _api_server(['--help'])
    if not argv or argv[0].startswith('-'):
        print(f'usage: {prog} {SERVE_USAGE}', file=sys.stderr)
        print(f'{prog}: error: MODEL is missing (a checkpoint directory or one of {", ".join(models.MODELS)}); '
              f'see {prog} --help', file=sys.stderr)
        return 2
    if not hook.is_installed():
        print(f"{prog}: error: the CPU path's hook is not installed ({hook.pth_path()}), so lmdeploy's engine "
              f'process would not run on the CPU; to fix: {sys.executable} -m lmdeploy_guided_spec.cpu install-hook '
              '(scripts/setup.sh runs it)', file=sys.stderr)
        return 2
    argv[0] = models.resolve(argv[0])
    for i, arg in enumerate(argv[:-1]):
        if arg == '--speculative-draft-model':
            argv[i + 1] = models.resolve(argv[i + 1])
    os.environ[ENV] = 'cpu'
    from . import activate
    activate()
    return _api_server(argv)


def _api_server(argv: list[str]) -> int:
    from lmdeploy.cli import run
    sys.argv = ['lmdeploy', 'serve', 'api_server', *argv]
    try:
        return int(run() or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m lmdeploy_guided_spec.cpu',
                                     description="lmdeploy's PyTorch engine on the CPU")
    sub = parser.add_subparsers(dest='command', required=True)
    sub.add_parser('serve', help=f'lmdeploy serve api_server on the CPU: serve {SERVE_USAGE} (serve --help)',
                   add_help=False)
    p = sub.add_parser('models', help='build and print the named models')
    p.add_argument('names', nargs='*', metavar='NAME', help=f'default: all of {", ".join(models.MODELS)}')
    sub.add_parser('install-hook', help='install the .pth hook that activates the CPU path in child processes')
    sub.add_parser('uninstall-hook', help='remove the .pth hook')
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ['serve']:
        # argparse would take the api_server options (and --help) as its own
        return serve(argv[1:])
    args = parser.parse_args(argv)
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
