"""The pure parts of benchmarks/vs_upstream.py: per-step summaries, ratios, the table, the goals and the timers."""
from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
import threading
import time
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / 'benchmarks' / 'vs_upstream.py'
spec = importlib.util.spec_from_file_location('vs_upstream', PATH)
vs = importlib.util.module_from_spec(spec)
sys.modules['vs_upstream'] = vs  # dataclasses look their module up
spec.loader.exec_module(vs)


def cell(steps, tokens=0, row_forwards=0, outputs=None):
    return vs.Cell([vs.Step(*s) for s in steps], tokens, row_forwards, outputs or [])


def test_summary_keeps_only_steps_of_the_whole_batch():
    c = cell([(8, 0.30, 0.10, 0.05), (8, 0.50, 0.20, 0.07), (8, 0.40, 0.30, 0.09), (7, 9.0, 9.0, 9.0)],
             tokens=30, row_forwards=15)
    s = c.summary(8)
    assert s['steps'] == 3
    assert s['wall'] == pytest.approx(0.40)  # median
    assert s['exposed'] == pytest.approx(0.20) and s['cpu'] == pytest.approx(0.07)  # means
    assert s['tok_per_fwd'] == pytest.approx(2.0)
    empty = cell([(7, 1, 1, 1)]).summary(8)
    assert empty['steps'] == 0 and math.isnan(empty['wall']) and math.isnan(empty['tok_per_fwd'])


def test_json_round_trip():
    c = cell([(1, 0.1, 0.01, 0.02)], tokens=5, row_forwards=3, outputs=[[1, 2, 3]])
    assert vs.Cell.from_json(c.to_json()) == c


def test_ratio_and_differing():
    assert vs.ratio(1.0, 4.0) == 0.25
    assert math.isnan(vs.ratio(1.0, 0.0)) and math.isnan(vs.ratio(float('nan'), 1.0))
    assert vs.differing([[1, 2], [3]], [[1, 2], [3]]) == []
    assert vs.differing([[1, 2], [3]], [[1, 2], [4]]) == [1]
    assert vs.differing([[1]], [[1], [2]]) == [1]


def _results(up_exposed, ours_exposed, up_wall, ours_wall, ours_outputs=None):
    results = {'upstream': {}, 'ours': {}}
    for batch in (1, 8, 32):
        results['upstream']['eagle3', batch] = cell([(batch, up_wall, up_exposed, 0.01)] * 3, 6, 3, [[1, 2]])
        results['ours']['eagle3', batch] = cell([(batch, ours_wall, ours_exposed, 0.005)] * 3, 9, 3,
                                                ours_outputs or [[1, 2]])
    return results


def test_table_headline_and_goals():
    results = _results(0.040, 0.008, 0.5, 0.4)
    lines = vs.table(results, ['eagle3'], [1, 8, 32], 3)
    assert len(lines) == 2 + 3
    row = lines[-1].split()
    assert row[:3] == ['eagle3', '32', '3'] and row[-1] == 'yes'
    assert '0.200' in lines[-1] and '40.00' in lines[-1] and '8.00' in lines[-1]
    assert vs.headline(results) == pytest.approx(0.2)
    assert vs.goals(results, ['eagle3'], [1, 8, 32]) == []


def test_goals_name_what_was_missed():
    results = _results(0.040, 0.020, 0.5, 0.6, ours_outputs=[[1, 3]])
    missed = vs.goals(results, ['eagle3'], [1, 8, 32])
    assert any('exposed ratio' in m and '0.500' in m for m in missed)
    assert sum('wall per step' in m for m in missed) == 2  # batches 8 and 32, not 1
    assert sum('outputs differ' in m for m in missed) == 3
    assert 'NO (1/1)' in vs.table(results, ['eagle3'], [32], 3)[-1]
    assert math.isnan(vs.headline({'upstream': {}, 'ours': {}}))


def test_meter_counts_outermost_calls_on_the_engine_thread_only():
    meter = vs.Meter()
    meter.engine_thread = threading.get_ident()

    @meter.wrap
    def inner():
        time.sleep(0.02)

    @meter.wrap
    def outer():
        inner()
        time.sleep(0.02)

    outer()
    assert 0.035 < meter.exposed < 0.2  # inner is not counted twice
    exposed = meter.exposed
    worker = threading.Thread(target=outer)
    worker.start()
    worker.join()
    assert meter.exposed == exposed  # not the engine thread

    async def waited():
        await asyncio.sleep(0.02)

    asyncio.run(meter.wrap_async(waited)())
    assert meter.exposed - exposed > 0.015


def test_meter_counts_cpu_of_every_thread_once():
    meter = vs.Meter()

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    outer = meter.cpu_wrap(lambda: meter.cpu_wrap(spin)(0.03))
    threads = [threading.Thread(target=outer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0.055 < meter.cpu < 0.2
    before = meter.cpu
    meter.cpu_wrap(time.sleep)(0.05)  # waiting is not CPU time
    assert meter.cpu - before < 0.02


def test_merge_pools_steps_and_flags_runs_with_other_outputs():
    a = cell([(8, 0.3, 0.1, 0.05)], tokens=8, row_forwards=4, outputs=[[1, 2]])
    a.breakdown = {'fill': 0.1}
    b = cell([(8, 0.5, 0.3, 0.07)], tokens=4, row_forwards=4, outputs=[[1, 2]])
    b.breakdown = {'fill': 0.2, 'apply': 0.1}
    a.merge(b)
    assert len(a.steps) == 2 and a.summary(8)['exposed'] == pytest.approx(0.2)
    assert a.tokens_per_forward() == pytest.approx(1.5)
    assert a.breakdown == pytest.approx({'fill': 0.3, 'apply': 0.1})
    assert not a.unstable and vs.same_outputs(a, cell([], outputs=[[1, 2]])) == 'yes'
    a.merge(cell([], outputs=[[1, 3]]))
    assert a.unstable and vs.same_outputs(a, cell([], outputs=[[1, 2]])) == 'NO (repetitions differ)'
