"""The ``lmdeploy-guided-spec`` command: patch an installed lmdeploy, undo it, inspect it, maintain the series.

Exit codes: 0 ok, 1 check failed or series stale, 2 usage, 3 version mismatch, 4 files not pristine or modified,
5 patch does not apply, 6 git missing, 141 the reader of the output went away (``status | head -1``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from .. import series
from ..series import COMMAND, PatchError, devport, devseries
from ..version import __version__

__all__ = ['main', 'build_parser']


class _Report:
    """Counts warnings and errors so a failing run can end with patch-package's summary line."""

    def __init__(self) -> None:
        self.warnings = 0
        self.errors = 0

    def warn(self, message: str) -> None:
        self.warnings += 1
        print(f'warning: {message}', file=sys.stderr)

    def error(self, message: str) -> None:
        self.errors += 1
        print(f'error: {message}', file=sys.stderr)

    def summary(self) -> None:
        print(f'finished with {self.warnings} warning(s), {self.errors} error(s)', file=sys.stderr)


def _target(args: argparse.Namespace) -> series.Target:
    return series.locate_installed(args.site)


#: The commands that work on one lmdeploy installation and so take ``--site``.
_SITE_COMMANDS = re.compile(rf'({re.escape(COMMAND)} (?:apply|revert|status|verify-series|dev-checkout)'
                            r'(?: --[a-z][a-z-]*)*)')


def with_site(text: str, site: Path | None) -> str:
    """``text`` with ``--site DIR`` added to every command of this tool in it that takes one."""
    if site is None:
        return text
    return _SITE_COMMANDS.sub(lambda m: f'{m.group(1)} --site {shlex.quote(str(site))}', text)


def _cmd_apply(args: argparse.Namespace, report: _Report) -> int:
    target = _target(args)
    result = series.apply(target, series.select_series(target), dry_run=args.dry_run)
    for warning in result.warnings:
        report.warn(warning)
    if result.action == 'already applied':
        print(f'{result.series} is already applied to lmdeploy {target.version} at {target.package_dir}; '
              'nothing to do')
        return 0
    print(f'{result.action} {result.series} ({len(result.patches)} patch(es)) to lmdeploy {target.version} at '
          f'{target.package_dir}')
    for name in result.patches:
        print(f'  {name}')
    print(f'{"would write" if args.dry_run else "wrote"} {len(result.files)} file(s):')
    for rel in result.files:
        print(f'  {rel}')
    if not args.dry_run:
        print(f'state: {target.state_file}')
        print(with_site(f'undo with: {COMMAND} revert', args.site))
    return 0


def _cmd_revert(args: argparse.Namespace, report: _Report) -> int:
    target = _target(args)
    result = series.revert(target, force=args.force)
    for warning in result.warnings:
        report.warn(warning)
    if result.action == 'nothing to revert':
        print(f'nothing to revert: lmdeploy {target.version} at {target.package_dir} carries no applied series')
        return 0
    print(f'reverted {result.series} ({len(result.patches)} patch(es)); restored {len(result.files)} file(s) of '
          f'lmdeploy {target.version} to their pristine bytes:')
    for rel in result.files:
        print(f'  {rel}')
    return 0


_STATUS_FIX = {
    'modified': f'{COMMAND} revert --force && {COMMAND} apply',
    'stale': f'{COMMAND} revert && {COMMAND} apply',
    'partially applied': f'{COMMAND} apply',
}


def _cmd_status(args: argparse.Namespace, report: _Report) -> int:
    target = _target(args)
    series_dir = series.select_series(target)
    found = series.status(target, series_dir)
    print(f'lmdeploy {found.installed_version} at {target.package_dir}')
    print(f'series {series_dir.name} at {series_dir}')
    if not found.version_matches:
        print(f'lmdeploy {found.installed_version} is a patch release of {found.series_version}: every file the series '
              f'patches is byte-identical to lmdeploy {found.series_version}\'s')
    width = max([len('patch')] + [len(p.name) for p in found.patches])
    print(f'{"patch":<{width}}  state')
    for row in found.patches:
        print(f'{row.name:<{width}}  {row.state}')
    print('files:')
    for row in found.files:
        print(f'  {row.state:<9} {row.path}')
    print(f'overall: {found.overall}')
    if found.overall in _STATUS_FIX:
        report.error(with_site(f'the installed lmdeploy is {found.overall}; to fix: {_STATUS_FIX[found.overall]}',
                               args.site))
        return 1
    return 0


def _cmd_dev_checkout(args: argparse.Namespace, report: _Report) -> int:
    target = _target(args)
    series_dir = series.series_path(target.version)
    workdir = devseries.checkout(args.dir, target, series_dir)
    count = len(series.load_series(series_dir).patches) if series_dir.is_dir() else 0
    print(f'checked out pristine lmdeploy {target.version} with {count} patch commit(s) at {workdir}')
    drift = devseries.export(workdir, series_dir, dry_run=True)
    if drift:
        report.warn(f'exporting the unchanged checkout would rewrite {", ".join(c.name for c in drift)}; this git '
                    'formats patches differently from the one that produced the series')
    print(f'edit the commits after the `{devseries.PRISTINE_TAG}` tag (git commit --fixup, '
          f'git rebase -i --autosquash {devseries.PRISTINE_TAG}), then run: {COMMAND} dev-export {workdir}')
    return 0


def _cmd_dev_export(args: argparse.Namespace, report: _Report) -> int:
    version = devseries.checkout_version(args.dir)
    series_dir = series.series_path(version)
    changes = devseries.export(args.dir, series_dir, dry_run=args.dry_run)
    if not changes:
        print(f'{series_dir} is up to date with {Path(args.dir).absolute()}')
        return 0
    if args.dry_run:
        print(f'stale patches in {series_dir} (the checkout exports differently):')
        for change in changes:
            print(f'  {change.kind:<7} {change.name}')
        report.error(f'the series is stale; to fix: {COMMAND} dev-export {args.dir}')
        return 1
    print(f'updated {series_dir}:')
    for change in changes:
        print(f'  {change.kind:<7} {change.name}')
    return 0


def _cmd_dev_port(args: argparse.Namespace, report: _Report) -> int:
    target = _target(args)
    new_dir = series.series_path(target.version)
    if new_dir.is_dir() and any(new_dir.glob('*.patch')):
        raise devseries.DevSeriesError(f'lmdeploy {target.version} has a series already', path=new_dir,
                                       fix=f'edit it in a checkout: {COMMAND} dev-checkout DIR')
    old_dir = series.find_series(args.from_version)
    count = len(series.load_series(old_dir).patches)
    print(f'porting {old_dir.name} ({count} patch(es)) to lmdeploy {target.version} in {Path(args.dir).absolute()}')
    result = devport.port(args.dir, target, old_dir, args.from_sources, keep_going=args.keep_going,
                          progress=lambda p: print(f'  {p.state:<8} {p.name}'
                                                   + (f'  ({", ".join(p.files)})' if p.files else '')))
    states = [p.state for p in result.patches]
    print(', '.join(f'{states.count(s)} {s}' for s in ('applied', 'empty', 'conflict', 'pending') if s in states))
    workdir = result.workdir
    if result.stopped:
        stop = next(p for p in result.patches if p.state == 'conflict')
        report.error(f'{stop.name} conflicts; the checkout is mid-cherry-pick at {workdir}; to fix: resolve the '
                     f'conflicts in {", ".join(stop.files)}, `git add` them and run `git cherry-pick --continue` '
                     f'there (git goes on with the remaining patches, stopping at each conflict); then '
                     f'{COMMAND} dev-export {workdir}')
        return 1
    skipped = [p for p in result.patches if p.state == 'conflict']
    if skipped:
        report.warn(f'{len(skipped)} patch(es) conflict and were left out; port each by hand in {workdir}: '
                    + '; '.join(f'git cherry-pick {p.commit}  ({p.name})' for p in skipped))
    print(f'the new series is in the commits after the `{devseries.PRISTINE_TAG}` tag; review them, then run: '
          f'{COMMAND} dev-export {workdir}')
    return 0


def _cmd_verify_series(args: argparse.Namespace, report: _Report) -> int:
    target = _target(args)
    series_dir = series.select_series(target)
    try:
        devseries.check_applies(series_dir, target)
    except series.PatchDoesNotApplyError as err:
        report.error(str(err))
        return 1
    count = len(series.load_series(series_dir).patches)
    print(f'ok: the {count} patch(es) of {series_dir.name} apply in order to pristine lmdeploy {target.version}')
    return 0


def _cmd_check(args: argparse.Namespace, report: _Report) -> int:
    name = f'{__package__}.check'
    try:
        check = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        report.error(f'{name} is not part of this installation; to fix: pip install --force-reinstall '
                     'lmdeploy-guided-spec')
        return 2
    return int(check.main(args) or 0)


def _cmd_demo(args: argparse.Namespace, report: _Report) -> int:
    from . import demo
    return int(demo.main(args) or 0)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of the ``lmdeploy-guided-spec`` command."""
    parser = argparse.ArgumentParser(prog=COMMAND, description='Guided decoding with speculative decoding for the '
                                     'lmdeploy PyTorch engine: patch the installed lmdeploy and maintain the series.')
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    site = argparse.ArgumentParser(add_help=False)
    site.add_argument('--site', type=Path, default=None, metavar='DIR',
                      help='directory holding lmdeploy/ and its dist-info (default: the lmdeploy this Python imports)')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND')

    p = sub.add_parser('apply', parents=[site], help='apply the patch series to the installed lmdeploy')
    p.add_argument('--dry-run', action='store_true', help='check and patch in a temporary directory; write nothing')
    p.set_defaults(handler=_cmd_apply)

    p = sub.add_parser('revert', parents=[site], help='restore the pristine lmdeploy files')
    p.add_argument('--force', action='store_true', help='also restore files changed after apply, discarding edits')
    p.set_defaults(handler=_cmd_revert)

    p = sub.add_parser('status', parents=[site], help='show which patches are applied and which files are patched')
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser('check', help='run guided speculative decoding on the installed lmdeploy and verify the output')
    p.add_argument('--schema', type=Path, default=None, metavar='PATH', help='JSON schema file (default: built in)')
    p.add_argument('--steps', type=int, default=64, metavar='N', help='max new tokens per request (default: 64)')
    p.add_argument('--method', choices=['deepseek_mtp', 'eagle3', 'all'], default='all',
                   help='proposer to run (default: all)')
    p.add_argument('--num-spec-tokens', type=int, default=3, metavar='K', help='draft tokens per step (default: 3)')
    p.add_argument('--tokenizer', choices=['llama3', 'qwen3', 'deepseek'], default='llama3',
                   help='tokenizer (default: llama3)')
    p.add_argument('--seed', type=int, default=0, help='random seed (default: 0)')
    p.add_argument('--sampling', action='store_true', help='sample instead of greedy decoding')
    p.set_defaults(handler=_cmd_check)

    p = sub.add_parser('demo', help='a JSON-schema request through lmdeploy pipeline without and with speculative '
                       'decoding (eagle, grammar; fsm on an FSM request), side by side, on the CPU')
    p.add_argument('--model', choices=['smollm2', 'tiny', 'tiny-deepseek'], default='smollm2',
                   help='smollm2: SmolLM2-135M-Instruct with an EAGLE draft of its own layers; tiny / tiny-deepseek: '
                   'random tiny models with Eagle3 / MTP drafts (default: smollm2)')
    p.add_argument('--schema', type=Path, default=None, metavar='PATH', help='JSON schema file (default: built in)')
    p.add_argument('--prompt', default=None, metavar='TEXT', help='the user message (default: built in)')
    p.add_argument('--max-new-tokens', type=int, default=96, metavar='N', help='(default: 96)')
    p.add_argument('--num-spec-tokens', type=int, default=3, metavar='K', help='draft tokens per step (default: 3)')
    p.add_argument('--sampling', action='store_true', help='sample instead of greedy decoding')
    p.add_argument('--seed', type=int, default=0, help='random seed of sampling (default: 0)')
    p.add_argument('--method', default=None, metavar='METHOD',
                   help="run one method only (or a comma list): none, the model's draft method (eagle for smollm2, "
                   'eagle3 for tiny, deepseek_mtp for tiny-deepseek), grammar or fsm (default: all, side by side)')
    p.add_argument('--steps', action='store_true', help='print every speculative step')
    p.set_defaults(handler=_cmd_demo)

    # main() hands serve-cpu's arguments to the CPU path's serve before parsing (they are lmdeploy's options)
    sub.add_parser('serve-cpu', help='lmdeploy serve api_server on the CPU: serve-cpu MODEL [lmdeploy serve '
                   'api_server options]; MODEL may name a built-in model (serve-cpu --help)', add_help=False)

    p = sub.add_parser('dev-checkout', parents=[site],
                       help='create a git checkout of the pristine sources with the series as commits')
    p.add_argument('dir', type=Path, metavar='DIR', help='new directory for the checkout')
    p.set_defaults(handler=_cmd_dev_checkout)

    p = sub.add_parser('dev-export', help='write the commits of a checkout back to the series as patch files')
    p.add_argument('dir', type=Path, metavar='DIR', help='a checkout made by dev-checkout')
    p.add_argument('--dry-run', action='store_true', help='write nothing; exit 1 and list stale patches on a change')
    p.set_defaults(handler=_cmd_dev_export)

    p = sub.add_parser('dev-port', parents=[site],
                       help='start the series of the installed lmdeploy from the series of an older version: a '
                       'checkout with that series cherry-picked (three-way) onto the pristine sources')
    p.add_argument('--from', dest='from_version', required=True, metavar='VERSION',
                   help='the lmdeploy version whose series to port, e.g. 0.14.0')
    p.add_argument('--from-sources', type=Path, required=True, metavar='PATH',
                   help="that version's pristine lmdeploy, the merge bases: its wheel (.whl) or a directory holding "
                   'lmdeploy/')
    p.add_argument('--keep-going', action='store_true',
                   help='leave out a patch that conflicts and go on (default: stop there, mid-cherry-pick)')
    p.add_argument('dir', type=Path, metavar='DIR', help='new directory for the checkout')
    p.set_defaults(handler=_cmd_dev_port)

    p = sub.add_parser('verify-series', parents=[site],
                       help='check that the series applies to the pristine sources (git apply --check)')
    p.set_defaults(handler=_cmd_verify_series)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        Exit status: 0 ok, 1 check failed or stale, 2 usage, 3 version mismatch, 4 not pristine or modified,
        5 patch does not apply, 6 git missing.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ['serve-cpu']:
        from ..cpu.__main__ import serve
        return serve(argv[1:], prog=f'{COMMAND} serve-cpu')
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    report = _Report()
    try:
        code = args.handler(args, report)
        sys.stdout.flush()  # here, not at exit: a reader that went away is caught below
    except PatchError as err:
        report.error(with_site(str(err), getattr(args, 'site', None)))
        code = err.exit_code
    except BrokenPipeError:
        # the reader of the output went away (`status | head -1`): write nothing more, exit as SIGPIPE would have
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if report.errors or report.warnings:
        report.summary()
    return code


if __name__ == '__main__':
    sys.exit(main())
