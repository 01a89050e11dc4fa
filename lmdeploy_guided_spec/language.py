"""Whether a grammar accepts any string at all, decided on its rules (no tokenizer, no compilation).

A JSON schema can describe no instance (``{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}``, or an
object that requires itself). xgrammar converts such schemas without complaint (``defs_a ::= ((defs_a))``); a matcher
of the grammar then allows no token at all, or only an endless prefix, and decoding either dies on an all-masked
step or runs into ``max_new_tokens`` with output that can never be valid. Compiling the grammar to find out costs as
much as the real compile (seconds for large schemas); this module reads the rules xgrammar prints and computes which
rules derive a finite string (the classic productive-symbols fixpoint), in milliseconds.

The analysis errs on one side only: it says "empty" only when no rule path can end. Constructs it does not
understand make it answer "not empty".

Answers are cached by the grammar's text (a request is checked more than once on its way to the engine, and the
analysis is Python, linear in the grammar: about 1 s for the 0.8 MB grammar of a 4000-property schema, most of it
reading the rules).
"""
from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict

__all__ = ['language_is_empty', 'required_text_length']

_IDENT = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*')
_REPEAT = re.compile(r'\{\s*(\d+)\s*(?:,\s*(-?\d+)\s*)?\}')


#: Answers kept by :func:`language_is_empty` (keyed by a digest of the grammar text).
CACHE_SIZE = 1024
_cache: OrderedDict = OrderedDict()
_cache_lock = threading.Lock()


class _Unsupported(ValueError):
    pass


# expression nodes: ('lit',), ('none',) (a character class that matches nothing), ('ref', name), ('seq', [nodes]),
# ('alt', [nodes]), ('opt', node) (may be skipped)
def _skip_quoted(text: str, i: int, close: str) -> int:
    i += 1
    while i < len(text):
        if text[i] == '\\':
            i += 2
            continue
        if text[i] == close:
            return i + 1
        i += 1
    raise _Unsupported(f'unterminated {close}')


#: Escapes of single characters in the classes xgrammar prints.
_CLASS_ESCAPES = {'0': 0, 'a': 7, 'b': 8, 't': 9, 'n': 10, 'v': 11, 'f': 12, 'r': 13, 'e': 27}
_HEX_ESCAPES = {'x': 2, 'u': 4, 'U': 8}
MAX_CODE_POINT = 0x10FFFF


def _class_char(body: str, i: int) -> tuple[int, int]:
    """The code point of the class character at ``body[i]`` and the index after it."""
    if body[i] != '\\':
        return ord(body[i]), i + 1
    if i + 1 >= len(body):
        raise _Unsupported('class ends in a backslash')
    ch = body[i + 1]
    if ch in _HEX_ESCAPES:
        digits = body[i + 2:i + 2 + _HEX_ESCAPES[ch]]
        if len(digits) != _HEX_ESCAPES[ch] or not all(d in '0123456789abcdefABCDEF' for d in digits):
            raise _Unsupported(f'escape \\{ch}{digits}')
        return int(digits, 16), i + 2 + len(digits)
    if ch in _CLASS_ESCAPES:
        return _CLASS_ESCAPES[ch], i + 2
    if ch.isalnum():
        # a class escape such as \d or \s, or one this analysis does not know
        raise _Unsupported(f'escape \\{ch}')
    return ord(ch), i + 2


def _class_ranges(body: str) -> tuple:
    """The code-point ranges, sorted and disjoint, that the class with contents ``body`` (between ``[`` and ``]``)
    matches; raises :class:`_Unsupported` for contents it cannot read."""
    negated = body.startswith('^')
    if negated:
        body = body[1:]
    ranges, i = [], 0
    while i < len(body):
        low, i = _class_char(body, i)
        high = low
        if i + 1 < len(body) and body[i] == '-':
            high, i = _class_char(body, i + 1)
        if low <= high:
            ranges.append((low, high))
    merged = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    if not negated:
        return tuple(merged)
    complement, start = [], 0
    for low, high in merged:
        if low > start:
            complement.append((start, low - 1))
        start = high + 1
    if start <= MAX_CODE_POINT:
        complement.append((start, MAX_CODE_POINT))
    return tuple(complement)


def _class_is_empty(body: str) -> bool:
    """Whether the character class with contents ``body`` (between ``[`` and ``]``) matches no character: an empty
    class, or a negated one whose ranges cover every code point. Contents it cannot read count as not empty."""
    try:
        return not _class_ranges(body)
    except _Unsupported:
        return False


class _Parser:

    def __init__(self, text: str):
        self.text = text
        self.i = 0

    def _ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def _peek(self) -> str:
        self._ws()
        return self.text[self.i] if self.i < len(self.text) else ''

    def parse(self):
        node = self.alt()
        if self._peek():
            raise _Unsupported(f'unexpected {self.text[self.i:self.i + 10]!r}')
        return node

    def alt(self):
        options = [self.seq()]
        while self._peek() == '|':
            self.i += 1
            options.append(self.seq())
        return options[0] if len(options) == 1 else ('alt', options)

    def seq(self):
        items = []
        while self._peek() not in ('', '|', ')'):
            item = self.postfix()
            if item is not None:
                items.append(item)
        return ('seq', items)

    def postfix(self):
        node = self.atom()
        while True:
            ch = self._peek()
            if ch in ('*', '?'):
                self.i += 1
                node = None if node is None else self._repeat(node, 0)
            elif ch == '+':
                self.i += 1
            elif ch == '{':
                match = _REPEAT.match(self.text, self.i)
                if match is None:
                    raise _Unsupported('repetition')
                self.i = match.end()
                if node is not None:
                    node = self._repeat(node, int(match.group(1)))
            else:
                return node

    def _repeat(self, node, least: int):
        """``node`` repeated at least ``least`` times (``x*``, ``x?``: 0; ``x{m,n}``: m)."""
        return ('opt', node) if least == 0 else node

    def atom(self):
        ch = self._peek()
        if ch == '"':
            self.i = _skip_quoted(self.text, self.i, '"')
            return ('lit', )
        if ch == '[':
            start = self.i
            self.i = _skip_quoted(self.text, self.i, ']')
            # a class that matches no character ([^\s\S] in a regex) derives nothing
            return ('none', ) if _class_is_empty(self.text[start + 1:self.i - 1]) else ('lit', )
        if ch == '(':
            lookahead = self.text.startswith('(=', self.i)
            self.i += 2 if lookahead else 1
            node = self.alt()
            if self._peek() != ')':
                raise _Unsupported('unbalanced parenthesis')
            self.i += 1
            # a lookahead consumes nothing: it never makes a rule productive or unproductive here
            return None if lookahead else node
        match = _IDENT.match(self.text, self.i)
        if match is None:
            raise _Unsupported(f'unexpected {self.text[self.i:self.i + 10]!r}')
        self.i = match.end()
        if self.text.startswith('(', self.i):
            # a built-in terminal with arguments, e.g. Regex("[0-9]+", json_string=true): it matches strings
            self._skip_call()
            return ('lit', )
        return ('ref', match.group(0))

    def _skip_call(self) -> None:
        depth = 0
        while self.i < len(self.text):
            ch = self.text[self.i]
            if ch == '"':
                self.i = _skip_quoted(self.text, self.i, '"')
                continue
            self.i += 1
            if ch == '(':
                depth += 1
            elif ch == ')':
                depth -= 1
                if depth == 0:
                    return
        raise _Unsupported('unbalanced call')


def _rules(text: str, parser: type = _Parser) -> dict[str, object]:
    """The rules of a grammar's text by name, each body read by ``parser``."""
    rules = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition('::=')
        if not sep or not _IDENT.fullmatch(name.strip()):
            raise _Unsupported(f'not a rule: {line[:40]!r}')
        rules[name.strip()] = parser(body).parse()
    return rules


def language_is_empty(grammar, root: str = 'root') -> bool:
    """Whether ``grammar`` derives no finite string from ``root``.

    Parameters
    ----------
    grammar : xgrammar.Grammar or str
        A grammar, or the EBNF text xgrammar prints for one (``str(grammar)``).
    root : str, default: 'root'
        The start rule.

    Returns
    -------
    bool
        True only when the start rule cannot derive any finite string; False when it can, and when the text
        holds something this analysis does not read (it never refuses a grammar it does not understand).

    Pseudocode::

        vertices: each rule, and each node of each rule body (seq needs all items, alt one, a ref its rule)
        ready = literals; while ready: v = pop; for each vertex p waiting for v: p.needs -= 1; if 0: ready += p
        return root still needs something     # every edge followed once: linear in the grammar
    """
    text = str(grammar)
    key = (hashlib.blake2b(text.encode(), digest_size=16).digest(), root)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    empty = _language_is_empty(text, root)
    with _cache_lock:
        _cache[key] = empty
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return empty


def _link(rules: dict, build, rule_vertex: dict[str, int], refs: list[tuple[str, int]],
          parents: list[list[int]]) -> None:
    """Put each rule's body (its vertex from ``build``) under its rule's vertex, then each reference's vertex under
    the rule it names (a reference to no rule derives nothing: it stays waiting)."""
    for name, body in rules.items():
        parents[build(body)].append(rule_vertex[name])
    for name, v in refs:
        if name in rule_vertex:
            parents[rule_vertex[name]].append(v)


def _language_is_empty(text: str, root: str) -> bool:
    try:
        rules = _rules(text)
    except _Unsupported:
        return False
    if root not in rules:
        return False
    # every node of every rule body, and every rule, is a vertex: a sequence waits for all its items, an alternative
    # (or a rule, through its body) for one; a vertex found productive tells each vertex that waits for it once, so
    # every edge is followed once (looking at a whole rule again each time one of its references became productive
    # was quadratic: a rule that lists every optional property of an object refers to every rule of their chain)
    waiting: list[int] = []  # per vertex: how many more of its children must be productive
    parents: list[list[int]] = []  # per vertex: the vertices that wait for it
    ready: list[int] = []  # vertices found productive, their parents not yet told

    def vertex(needs: int) -> int:
        waiting.append(needs)
        parents.append([])
        if needs == 0:
            ready.append(len(waiting) - 1)
        return len(waiting) - 1

    rule_vertex = {name: vertex(1) for name in rules}
    refs: list[tuple[str, int]] = []

    def build(node) -> int:
        kind = node[0]
        if kind in ('lit', 'opt'):
            return vertex(0)
        if kind == 'none':
            return vertex(1)  # nothing ever tells it
        if kind == 'ref':
            v = vertex(1)
            refs.append((node[1], v))
            return v
        items = node[1]
        v = vertex(len(items) if kind == 'seq' else min(1, len(items)))
        for item in items:
            parents[build(item)].append(v)
        return v

    _link(rules, build, rule_vertex, refs, parents)
    while ready:
        for parent in parents[ready.pop()]:
            waiting[parent] -= 1
            if waiting[parent] == 0:
                ready.append(parent)
    return waiting[rule_vertex[root]] > 0


# -- the longest text a part of a grammar requires -------------------------------------------------------------
# nodes: ('len', n) (n characters of fixed text: a literal, a class of one character), ('ref', name),
# ('seq', [nodes]), ('alt', [nodes]), ('rep', node, least) (a node repeated at least `least` times: 0 for ?, *,
# {0,n}, 1 for +)
#: Lengths past this are counted as this (a grammar's numbers stay small integers).
_LENGTH_CAP = 10 ** 18


def _literal_length(text: str) -> int:
    """Characters of a literal as xgrammar prints it, quotes included (each escape is one character)."""
    count, i = 0, 1
    while i < len(text) - 1:
        if text[i] == '\\':
            kind = text[i + 1] if i + 1 < len(text) else ''
            i += 2 + _HEX_ESCAPES.get(kind, 0)
        else:
            i += 1
        count += 1
    return count


class _LengthParser(_Parser):
    """Reads a rule body into the nodes of :func:`required_text_length`."""

    def _repeat(self, node, least: int):
        return ('rep', node, least)

    def atom(self):
        ch = self._peek()
        if ch == '"':
            start = self.i
            self.i = _skip_quoted(self.text, self.i, '"')
            return ('len', _literal_length(self.text[start:self.i]))
        if ch == '[':
            start = self.i
            self.i = _skip_quoted(self.text, self.i, ']')
            try:
                ranges = _class_ranges(self.text[start + 1:self.i - 1])
            except _Unsupported:
                ranges = ()
            # a class of one character is fixed text (a deterministic grammar writes its literals so); one of
            # several forces nothing
            return ('len', 1 if len(ranges) == 1 and ranges[0][0] == ranges[0][1] else 0)
        node = super().atom()
        return ('len', 0) if node == ('lit', ) else node


def required_text_length(grammar) -> int:
    """The most characters of fixed text that one sequence of one rule of ``grammar`` requires: the fewest that its
    texts hold of literals and one-character classes (counted repetitions multiply them: ``a{1000}`` requires 1,000;
    a class of several characters, ``[a-z]{1000}``, forces nothing and counts 0). Where a state's text is forced, the
    forced text is at most about this long, and xgrammar's jump-forward string builds it whole. 0 where the text
    holds something this analysis does not read.

    Pseudocode (Knuth's generalisation of Dijkstra's shortest paths: a sum, a minimum and a count times a length are
    never less than what they read, so values leave the heap in order and each is final when it leaves)::

        vertices: each rule, and each node of each rule body; leaves (literals, classes, x* and x?) on the heap
        while heap: v = pop the least; for each parent p of v: an alternative (a rule) takes its first child's
            value; a sequence its children's sum once all are known; a count m times its child's; push p when known
        return the largest value of any sequence
    """
    try:
        rules = _rules(str(grammar), _LengthParser)
    except _Unsupported:
        return 0
    import heapq
    # per vertex: its kind ('alt' takes its first known child, 'seq' the sum of all, 'rep' a count times its one
    # child), how many children it still waits for, the sum so far (a sequence) or the count (a repetition)
    kinds: list[str] = []
    waiting: list[int] = []
    values: list[int] = []
    parents: list[list[int]] = []
    known: list[bool] = []
    heap: list[tuple[int, int]] = []

    def vertex(kind: str, needs: int, value: int = 0) -> int:
        kinds.append(kind)
        waiting.append(needs)
        values.append(value)
        parents.append([])
        known.append(False)
        if needs == 0:
            heapq.heappush(heap, (value, len(kinds) - 1))
        return len(kinds) - 1

    rule_vertex = {name: vertex('alt', 1) for name in rules}
    refs: list[tuple[str, int]] = []

    def build(node) -> int:
        kind = node[0]
        if kind == 'len':
            return vertex('len', 0, node[1])
        if kind == 'ref':
            v = vertex('alt', 1)
            refs.append((node[1], v))
            return v
        if kind == 'rep':
            if node[2] == 0:
                return vertex('len', 0, 0)
            v = vertex('rep', 1, node[2])
            parents[build(node[1])].append(v)
            return v
        items = node[1]
        if not items:
            return vertex('seq', 0, 0)
        v = vertex(kind, len(items) if kind == 'seq' else 1)
        for item in items:
            parents[build(item)].append(v)
        return v

    _link(rules, build, rule_vertex, refs, parents)
    longest = 0
    while heap:
        value, v = heapq.heappop(heap)
        if known[v]:
            continue
        known[v] = True
        if kinds[v] == 'seq':
            longest = max(longest, value)
        for parent in parents[v]:
            if known[parent] or waiting[parent] == 0:
                continue
            kind = kinds[parent]
            if kind == 'alt':
                waiting[parent], values[parent] = 0, value
            elif kind == 'rep':
                waiting[parent], values[parent] = 0, min(_LENGTH_CAP, values[parent] * value)
            else:
                waiting[parent] -= 1
                values[parent] = min(_LENGTH_CAP, values[parent] + value)
            if waiting[parent] == 0:
                heapq.heappush(heap, (values[parent], parent))
    return longest
