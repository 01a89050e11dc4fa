"""The engine's startup line and per-request speculative decoding counts, through ``pipeline`` on the CPU path.

Method ``grammar`` with guessed drafts off: every draft is a token the grammar forces, or a token the grammar
disallows (verification rejects it, and the rest of the window is unreachable). So the forced drafts of a window
are exactly its leading drafts the grammar accepts, which a fresh xgrammar matcher replays from the recorded steps,
independently of the engine's counting.
"""
import logging
import os

import pytest
from e2e_helpers import ENGINE_KWARGS, gen_config

K = 4
# after the code the grammar forces the whole tail, tokens the target may write differently (and so reject)
TAIL_REGEX = r'[A-Z]{2}-[0-9]{3}, confirmed by the office'
FORMAT = {'type': 'regex_schema', 'regex_schema': TAIL_REGEX}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture(scope='module')
def run(cpu_path):
    """One engine (method grammar, k=4, guessed drafts off, metrics on) and one guided request, recorded."""
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig
    from lmdeploy.pytorch.engine import engine_loop

    from lmdeploy_guided_spec.cpu import models
    from lmdeploy_guided_spec.cpu.steps import StepRecorder
    logger = logging.getLogger('lmdeploy')
    capture = _Capture()
    logger.addHandler(capture)
    saved = os.environ.get('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS')
    os.environ['LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS'] = '0'
    spec_infos = []
    request_metrics = engine_loop.RequestMetrics

    def recording(*args, **kwargs):
        metrics = request_metrics(*args, **kwargs)
        spec_infos.append(metrics.spec_info)
        return metrics

    pipe = None
    try:
        pipe = pipeline(models.resolve('tiny-llama'),
                        backend_config=PytorchEngineConfig(**{**ENGINE_KWARGS, 'max_batch_size': 4},
                                                           enable_metrics=True),
                        speculative_config=SpeculativeConfig(method='grammar', num_speculative_tokens=K),
                        log_level='INFO')
        startup = list(capture.messages)
        engine_loop.RequestMetrics = recording
        logger.setLevel(logging.DEBUG)
        with StepRecorder() as recorder:
            out = pipe(['Write an order code.'], gen_config=gen_config(FORMAT, max_new_tokens=48))[0]
        logger.setLevel(logging.ERROR)
        yield dict(startup=startup, messages=list(capture.messages), out=out, rows=recorder.rows(),
                   spec_infos=spec_infos)
    finally:
        engine_loop.RequestMetrics = request_metrics
        logger.removeHandler(capture)
        logger.setLevel(logging.ERROR)
        if saved is None:
            os.environ.pop('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', None)
        else:
            os.environ['LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS'] = saved
        if pipe is not None:
            pipe.close()


def _expected(rows, out, tokenizer_info_matcher):
    """Counts replayed from the recorded steps: forwards up to the one that committed the last token."""
    needed = len(out.token_ids) + (out.finish_reason == 'stop')
    committed, used = 0, []
    for row in rows:
        if committed >= needed:
            break
        used.append(row)
        committed += len(row.output)
    matcher = tokenizer_info_matcher()
    stops = set(matcher.stop_token_ids)
    forced = 0
    for row in used:
        fork = matcher.fork()
        for token in row.drafts:
            if token in stops:
                forced += fork.is_terminated()
                break
            if not fork.accept_token(token):
                break
            forced += 1
        for token in row.output:
            if token in stops:
                break
            assert matcher.accept_token(token)
    decoding = [r for r in used if r.drafts]
    return dict(forwards=len(used), drafted=K * len(decoding), forced=forced,
                accepted=sum(len(r.output) - 1 for r in decoding))


def _grammar_matcher():
    import xgrammar as xgr

    from lmdeploy_guided_spec import testing
    tokenizer = testing.load_tokenizer('llama3')
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=128256)
    grammar = xgr.GrammarCompiler(info).compile_regex(TAIL_REGEX)
    return lambda: xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)


def test_startup_line_names_the_series_and_its_settings(run):
    from lmdeploy import __version__ as lmdeploy_version

    from lmdeploy_guided_spec import __version__
    lines = [m for level, m in run['startup'] if level == logging.INFO and m.startswith('lmdeploy-guided-spec ')]
    assert len(lines) == 1, run['startup'][-20:]
    line = lines[0]
    assert f'lmdeploy-guided-spec {__version__} active on lmdeploy {lmdeploy_version}' in line
    assert "speculative method 'grammar', k=4" in line
    assert 'compile service: a child process, limit 30 s' in line
    assert 'guessed drafts: off' in line and 'forced drafts in draft-model windows: on' in line


def test_per_request_counts_in_the_debug_log_and_in_metrics(run):
    out = run['out']
    assert out.finish_reason == 'stop' and out.text.endswith(', confirmed by the office'), out
    expected = _expected(run['rows'], out, _grammar_matcher())
    assert expected['forced'] > 0 and expected['accepted'] > 0, expected
    lines = [m for level, m in run['messages'] if level == logging.DEBUG and 'speculative decoding:' in m]
    assert len(lines) == 1, lines
    tokens = len(out.token_ids) + 1  # and the EOS that ended it
    assert lines[0].endswith(
        f"speculative decoding: {expected['drafted']} drafted, {expected['forced']} forced by the grammar, "
        f"{expected['accepted']} accepted; {tokens} tokens in {expected['forwards']} target forwards "
        f"({tokens / expected['forwards']:.2f} per forward)"), (lines[0], expected)
    # lmdeploy's own per-step spec_info carries the forced drafts; its stats add them up
    from lmdeploy.messages import EngineOutput, RequestMetrics, ResponseType
    from lmdeploy.metrics.stats import SpeculativeDecodingStats
    infos = [i for i in run['spec_infos'] if i]
    assert sum(i['num_forced_tokens'] for i in infos) == expected['forced'], infos
    stats = SpeculativeDecodingStats(K)
    for info in infos:
        stats.update_from_output(EngineOutput(ResponseType.SUCCESS, [], req_metrics=RequestMetrics(spec_info=info)))
    assert stats.num_forced_tokens == expected['forced'] and f"num_forced_tokens={expected['forced']}" in repr(stats)
