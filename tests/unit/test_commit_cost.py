"""benchmarks/commit_cost.py runs and prints its table and last line (a tiny configuration; figures not judged)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_commit_cost_prints_a_table_and_its_last_line():
    out = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'commit_cost.py'), '--tokenizers', 'llama3',
                          '--batches', '4,128', '--steps', '2', '--reps', '1'],
                         capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()
    rows = [line.split() for line in out if line.startswith('llama3')]
    assert [row[1] for row in rows] == ['4', '128'], out
    assert all(float(cell) >= 0 for row in rows for cell in row[3:] if cell != '|'), out
    name, value = out[-1].split()
    assert name == 'commit_free_vs_default_b128' and float(value) > 0, out
