"""The non-speculative path's accepts are timed as its masks are (0.18.0 patch 0093, 0.14.0 patch 0092): lmdeploy's
``GuidedDecodingManager.accept_token`` charges each accept of a request's matcher to the mask clock, so a grammar
whose accepts grow slow faster than its masks is refused as one whose masks do."""
import pytest
import xgrammar as xgr

from lmdeploy_guided_spec import compile as compile_module
from lmdeploy_guided_spec.mask_clock import MaskClock
from lmdeploy_guided_spec.testing import load_tokenizer, tokenizer_info

pytestmark = pytest.mark.engine

#: an ambiguous regex whose accepts over runs of x grow slow faster than its masks (264 ms an accept beside 65 ms a
#: mask, 27 tokens in, on a 2-core EPYC)
AMBIGUOUS = '((x|xx)+ ?){1,300}'


def test_the_accepts_of_a_request_are_timed():
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
    tokenizer = load_tokenizer('llama3')
    info = tokenizer_info('llama3')
    manager = GuidedDecodingManager(tokenizer, info.vocab_size)
    manager.mask_clock = MaskClock(limit_ms=5)
    grammar = compile_module._compile(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), 'regex',
                                      AMBIGUOUS, {})
    token, = tokenizer.encode('xxxxxxxx', add_special_tokens=False)
    matcher, untimed = xgr.GrammarMatcher(grammar), xgr.GrammarMatcher(grammar)
    over, count = {}, 0
    while not over and count < 60:
        count += 1
        manager.accept_token(matcher, token, (7, 0))
        # without a key (the calls of lmdeploy's own guided speculation) nothing is timed
        manager.accept_token(untimed, token)
        over = manager.pop_slow_grammars()
    assert list(over) == [7] and 'an accept of the running request' in over[7], (count, over)
    assert compile_module.MASK_LIMIT_ENV in over[7]
    # the accepts themselves are counted as before
    assert manager.num_accepted[(7, 0)] == count
    # a request whose accepts are cheap is never over
    cheap = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_regex('[a-z ]{1,500}'))
    for word in tokenizer.encode(' the quick brown fox jumps over the lazy dog' * 8, add_special_tokens=False):
        manager.accept_token(cheap, word, (8, 0))
    assert manager.pop_slow_grammars() == {}
