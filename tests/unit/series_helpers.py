"""Helpers of the series tooling tests: git with a fixed identity and no user configuration, and file snapshots."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

GIT_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith('GIT_')},
    'GIT_CONFIG_GLOBAL': os.devnull,
    'GIT_CONFIG_NOSYSTEM': '1',
    'GIT_AUTHOR_NAME': 'Patch Author',
    'GIT_AUTHOR_EMAIL': 'author@example.com',
    'GIT_AUTHOR_DATE': '2025-03-01T12:00:00+0000',
    'GIT_COMMITTER_NAME': 'Patch Author',
    'GIT_COMMITTER_EMAIL': 'author@example.com',
    'GIT_COMMITTER_DATE': '2025-03-01T12:00:00+0000',
    'GIT_EDITOR': 'true',
}


def git(cwd: Path, *args: str) -> str:
    """Run git in ``cwd``; its stdout."""
    return subprocess.run(['git', *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True).stdout


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root``: posix path -> bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob('*')) if p.is_file()}
