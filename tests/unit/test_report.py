"""The engine's startup line and per-request counts (lmdeploy_guided_spec.report)."""
import pytest

from lmdeploy_guided_spec import SpecCounts, __version__, startup_message

pytestmark = pytest.mark.unit


def test_the_startup_line_names_the_series_method_and_settings(monkeypatch):
    monkeypatch.delenv('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', raising=False)
    monkeypatch.delenv('LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS', raising=False)
    monkeypatch.delenv('LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS', raising=False)
    monkeypatch.delenv('LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS', raising=False)
    monkeypatch.delenv('LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS', raising=False)
    monkeypatch.delenv('LMDEPLOY_GUIDED_SPEC_MATCHER_LIMIT_MB', raising=False)
    line = startup_message('0.14.0', 'eagle3', 3, compile_timeout_s=30.0)
    assert line.startswith(f'lmdeploy-guided-spec {__version__} active on lmdeploy 0.14.0: '
                           "speculative method 'eagle3', k=3; grammar: ")
    assert ('compile service: a child process, limit 30 s (LMDEPLOY_GUIDED_SPEC_COMPILE_TIMEOUT), token masks up to '
            '250 ms (LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS), matchers up to 64 MB (LMDEPLOY_GUIDED_SPEC_MATCHER_LIMIT_MB);'
            ) in line
    assert "whitespace: 'any'" in line
    assert 'draft-model logits masked: on; forced drafts in draft-model windows: on' in line
    assert 'guessed drafts: format,lookup' in line
    assert line.endswith("switch interval: Python's (LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS)")


def test_the_startup_line_follows_the_environment(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', 'lookup')
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS', '0')
    line = startup_message('0.14.0')
    assert 'no speculative decoding' in line
    assert 'compile service: off' in line
    assert 'forced drafts in draft-model windows: off' in line and 'guessed drafts: lookup' in line
    assert ('guessed drafts: lookup (LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS); none in draft-model windows, '
            'as forced drafts') in line
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS', '1')
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS', '0')
    line = startup_message('0.18.0', 'eagle3', 3)
    assert ('draft-model logits masked: off (LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0; verification only); '
            'forced drafts in draft-model windows: off (with LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0); guessed drafts: '
            'lookup (LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS); none in draft-model windows, as forced drafts') in line
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_MATCHER_LIMIT_MB', 'inf')
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS', 'slow')
    line = startup_message('0.18.0', 'eagle3', 3, compile_timeout_s=5)
    assert ("token masks invalid (LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS='slow' is not a number of milliseconds) "
            '(LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS), matchers unlimited (LMDEPLOY_GUIDED_SPEC_MATCHER_LIMIT_MB)') in line
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS', '0.2')
    assert startup_message('0.18.0').endswith('switch interval: 0.2 ms (LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS)')
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS', 'fast')
    assert 'switch interval: invalid (LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS=' in startup_message('0.18.0')
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', 'nonsense')
    assert 'guessed drafts: invalid' in startup_message('0.14.0', 'grammar', 2)


def test_counts_add_the_forced_drafts_of_a_window_when_it_is_verified():
    counts = SpecCounts()
    # prefill: one token, a window of 3 drafted with 2 forced
    assert counts.step(decoding=False, num_spec_tokens=3, num_accepted=0, num_tokens=1, next_forced=2) == 0
    # it is verified: 2 accepted, 3 tokens; the next window has 1 forced
    assert counts.step(decoding=True, num_spec_tokens=3, num_accepted=2, num_tokens=3, next_forced=1) == 2
    # the last window: nothing accepted, the EOS
    assert counts.step(decoding=True, num_spec_tokens=3, num_accepted=0, num_tokens=1, next_forced=3) == 1
    assert (counts.forwards, counts.drafted, counts.forced, counts.accepted, counts.tokens) == (3, 6, 3, 2, 5)
    assert counts.message(7) == ('session 7 speculative decoding: 6 drafted, 3 forced by the grammar, 2 accepted; '
                                 '5 tokens in 3 target forwards (1.67 per forward)')
