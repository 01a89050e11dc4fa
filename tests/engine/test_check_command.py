"""The README's main job: `lmdeploy-guided-spec check` runs the patched components and validates its output."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


@pytest.mark.parametrize('method', ['deepseek_mtp', 'eagle3'])
def test_check_command_validates_and_matches_non_speculative(method):
    proc = subprocess.run([sys.executable, '-m', 'lmdeploy_guided_spec.cli', 'check', '--method', method],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'valid JSON: yes; schema: valid' in proc.stdout
    assert 'greedy guided decoding without speculation: identical' in proc.stdout
    assert f'{method}: ok' in proc.stdout
