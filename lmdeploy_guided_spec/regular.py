"""A ``regex_schema`` compiled as a deterministic grammar, so that one request's regex cannot stall the engine.

xgrammar turns a regex into rules of its grammar (``xgr.Grammar.from_regex``) and matches them with its parser. For
a regex with nested or adjacent quantifiers the rules are ambiguous, and the parser's work per token grows with the
tokens already accepted: ``(a*b*)*c`` costs 20 ms per mask after 150 tokens, ``([a-zA-Z0-9]+\\s?)*`` over plain words
0.1 s, a common URL regex (``([\\/\\w \\.-]*)*``) 5 s after 12 tokens, and ``((a*)*)*b`` minutes. The engine fills
the masks of all guided rows on one worker each step, so every request waits for the slowest grammar. (xgrammar's
own regex automaton, ``Regex("...")`` in a grammar, is fast but not language-preserving in 0.2.8: it accepts "01"
for ``(0|1\\d*)(x\\d+)?``; see :func:`exact_patterns_grammar`.)

Here the rules xgrammar makes of the regex (its dialect: what ``\\s``, ``.`` and escapes mean) become a
nondeterministic automaton over code-point ranges, then a minimal deterministic one, printed as a grammar with one
rule per state (``s3 ::= "" | [0-9] s3 | [.] s4``). Such a grammar is unambiguous and its parser keeps one state per
position: the cost of a mask stays flat however long the output. The language is the one ``from_regex`` gives
(masks and forced strings are equal token by token; ``tests/unit/test_regular.py``).

A regex without a loop (no ``*``, ``+`` or ``{n,}``: its parse state stays bounded), a regex whose rules this module
does not read (a lookahead, a class that matches nothing), and one whose automaton would be large (counted repetitions
such as ``[a-z]{1,500}``, or a deterministic blow-up such as ``(a|b)*a(a|b){20}``) are compiled by xgrammar as
before.

A JSON schema's ``pattern`` that xgrammar compiles inexactly (its automaton, or its rules of a pattern with
characters beyond ASCII, which take a raw quote or newline inside the JSON string) gets the same kind of rules,
written inside a JSON string: :func:`compile_json_schema`.
"""
from __future__ import annotations

import functools
import json

import xgrammar as xgr
from xgrammar.testing import _get_matcher_from_grammar

from .language import (
    _IDENT,
    _REPEAT,
    _class_char,
    _class_ranges,
    _Parser,
    _rules,
    _skip_quoted,
    _Unsupported,
)

__all__ = ['deterministic_grammar', 'compile_regex', 'pattern_counterexample', 'MAX_NFA_STATES', 'MAX_DFA_STATES']

#: Largest automaton built before giving the regex to xgrammar as it is (counted repetitions multiply states).
MAX_NFA_STATES = 20000
#: Largest automaton :func:`pattern_counterexample` builds for a JSON-schema pattern (larger ones are not probed).
MAX_PROBED_NFA_STATES = 1000
#: Largest deterministic automaton printed as a grammar; larger ones are left to xgrammar (its compile computes
#: token masks for every rule, so a grammar of many states compiles slowly).
MAX_DFA_STATES = 256
#: Largest deterministic automaton built before minimizing it: ``([a-z]+ ?){1,60}`` ("up to 60 words") takes 3,602
#: subsets of its automaton's states and minimizes to 121 states (about 2 s on two cores); xgrammar's own rules of
#: it cost half a second per token mask from the first token on.
MAX_SUBSETS = 4096

# expression nodes: ('chars', ranges) with ranges a tuple of (low, high) code points; ('seq', [nodes]);
# ('alt', [nodes]); ('ref', name); ('rep', node, low, high) with high -1 for no bound


class _Rules(_Parser):
    """Parser of the rules xgrammar prints for a regex, keeping what each terminal matches (the emptiness analysis'
    parser keeps only whether it matches anything)."""

    def seq(self):
        items = []
        while self._peek() not in ('', '|', ')'):
            items.append(self.postfix())
        return items[0] if len(items) == 1 else ('seq', items)

    def postfix(self):
        node = self.atom()
        while True:
            ch = self._peek()
            if ch == '*':
                node = ('rep', node, 0, -1)
            elif ch == '+':
                node = ('rep', node, 1, -1)
            elif ch == '?':
                node = ('rep', node, 0, 1)
            elif ch == '{':
                match = _REPEAT.match(self.text, self.i)
                if match is None:
                    raise _Unsupported('repetition')
                low = int(match.group(1))
                high = low if match.group(2) is None else int(match.group(2))
                if high != -1 and high < low:
                    raise _Unsupported('repetition')
                node = ('rep', node, low, high)
                self.i = match.end()
                continue
            else:
                return node
            self.i += 1

    def atom(self):
        ch = self._peek()
        if ch == '"':
            start = self.i
            self.i = _skip_quoted(self.text, self.i, '"')
            body, chars, j = self.text[start + 1:self.i - 1], [], 0
            while j < len(body):
                code, j = _class_char(body, j)
                chars.append(('chars', ((code, code), )))
            return chars[0] if len(chars) == 1 else ('seq', chars)
        if ch == '[':
            start = self.i
            self.i = _skip_quoted(self.text, self.i, ']')
            return ('chars', _class_ranges(self.text[start + 1:self.i - 1]))
        if ch == '(':
            if self.text.startswith('(=', self.i):
                raise _Unsupported('lookahead')
            self.i += 1
            node = self.alt()
            if self._peek() != ')':
                raise _Unsupported('unbalanced parenthesis')
            self.i += 1
            return node
        match = _IDENT.match(self.text, self.i)
        if match is None or self.text.startswith('(', match.end()):
            # not a rule name, or a built-in terminal such as Regex(...)
            raise _Unsupported(f'unexpected {self.text[self.i:self.i + 10]!r}')
        self.i = match.end()
        return ('ref', match.group(0))


class _NFA:
    """A nondeterministic automaton built right to left: :meth:`build` takes the state a node's strings lead to and
    returns the state they start from. A rule referred to in tail position of itself (how xgrammar writes ``*`` and
    ``+``) becomes a loop; any other recursion is not regular here and is refused."""

    def __init__(self, rules: dict, max_states: int = MAX_NFA_STATES):
        self.rules = rules
        self.max_states = max_states
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple]] = []  # (ranges, target)
        self._entries: dict = {}  # (rule, continuation) -> start state
        self._building: set = set()
        #: Loops built (``*``, ``+``, a rule that refers to itself): a regex without any is left to xgrammar
        self.loops = 0

    def state(self) -> int:
        if len(self.eps) >= self.max_states:
            raise _Unsupported(f'more than {self.max_states} automaton states')
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node, then: int) -> int:
        kind = node[0]
        if kind == 'chars':
            if not node[1]:
                # a class that matches nothing ([^\\s\\S]): xgrammar's grammar keeps the dead end, and the engine
                # fails the request that runs into it with the reason (the automaton would drop the branch)
                raise _Unsupported('a character class that matches nothing')
            start = self.state()
            self.edges[start].append((node[1], then))
            return start
        if kind == 'seq':
            for item in reversed(node[1]):
                then = self.build(item, then)
            return then
        if kind == 'alt':
            start = self.state()
            self.eps[start].extend(self.build(option, then) for option in node[1])
            return start
        if kind == 'rep':
            _, body, low, high = node
            if high == -1:
                self.loops += 1
                loop = self.state()
                self.eps[loop].extend((then, self.build(body, loop)))
                start = loop
            else:
                start = then
                for _ in range(high - low):
                    optional = self.state()
                    self.eps[optional].extend((then, self.build(body, start)))
                    start = optional
            for _ in range(low):
                start = self.build(body, start)
            return start
        if kind == 'ref':
            name = node[1]
            key = (name, then)
            if key in self._entries:
                self.loops += name in self._building
                return self._entries[key]
            if name in self._building or name not in self.rules:
                raise _Unsupported(f'rule {name} is recursive other than in tail position, or undefined')
            entry = self.state()
            self._entries[key] = entry
            self._building.add(name)
            try:
                self.eps[entry].append(self.build(self.rules[name], then))
            finally:
                self._building.discard(name)
            return entry
        raise AssertionError(kind)

    def closure(self, states) -> frozenset:
        seen, stack = set(states), list(states)
        while stack:
            for nxt in self.eps[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen)


def _split(edges) -> list[tuple[int, int, frozenset]]:
    """Disjoint ranges, each with the targets of the edges that match it, from ``(ranges, target)`` edges."""
    points = set()
    for ranges, _ in edges:
        for low, high in ranges:
            points.add(low)
            points.add(high + 1)
    bounds = sorted(points)
    out = []
    for low, nxt in zip(bounds, bounds[1:]):
        targets = frozenset(t for ranges, t in edges if any(lo <= low <= hi for lo, hi in ranges))
        if targets:
            out.append((low, nxt - 1, targets))
    return out


def _determinize(nfa: _NFA, start: int, final: int):
    """Subset construction: ``(accepting, transitions)`` per state (state 0 the start), transitions a list of
    ``(low, high, target)``."""
    first = nfa.closure([start])
    index = {first: 0}
    sets, accepting, transitions = [first], [], []
    while len(transitions) < len(sets):
        current = sets[len(transitions)]
        accepting.append(final in current)
        edges = [edge for s in current for edge in nfa.edges[s]]
        moves = []
        for low, high, targets in _split(edges):
            target = nfa.closure(targets)
            if target not in index:
                if len(sets) >= MAX_SUBSETS:
                    raise _Unsupported(f'more than {MAX_SUBSETS} deterministic states before minimizing')
                index[target] = len(sets)
                sets.append(target)
            moves.append((low, high, index[target]))
        transitions.append(moves)
    return accepting, transitions


def _merge(moves) -> tuple:
    """Adjacent ranges with the same target joined, sorted by code point."""
    out = []
    for low, high, target in sorted(moves):
        if out and out[-1][2] == target and out[-1][1] + 1 == low:
            out[-1] = (out[-1][0], high, target)
        else:
            out.append((low, high, target))
    return tuple(out)


def _minimize(accepting, transitions):
    """States that cannot reach an accepting state dropped, the rest merged into classes of equal futures (Moore's
    refinement). Returns ``(accepting, transitions)`` of the minimal automaton, start state 0, or None for an empty
    language."""
    n = len(accepting)
    # co-reachable: states from which some accepting state can be reached
    reverse = [[] for _ in range(n)]
    for s, moves in enumerate(transitions):
        for _, _, t in moves:
            reverse[t].append(s)
    alive = {s for s in range(n) if accepting[s]}
    stack = list(alive)
    while stack:
        for s in reverse[stack.pop()]:
            if s not in alive:
                alive.add(s)
                stack.append(s)
    if 0 not in alive:
        return None
    moves = {s: [(lo, hi, t) for lo, hi, t in transitions[s] if t in alive] for s in alive}
    block = {s: int(accepting[s]) for s in alive}
    while True:
        signatures = {s: (block[s], _merge((lo, hi, block[t]) for lo, hi, t in moves[s])) for s in alive}
        numbering: dict = {}
        refined = {s: numbering.setdefault(signatures[s], len(numbering)) for s in sorted(alive)}
        if len(numbering) == len(set(block.values())):
            block = refined
            break
        block = refined
    # renumber so that the start state's class is 0, in order of first visit
    order = {block[0]: 0}
    stack = [0]
    representative = {block[0]: 0}
    while stack:
        s = stack.pop()
        for _, _, t in moves[s]:
            if block[t] not in order:
                order[block[t]] = len(order)
                representative[block[t]] = t
                stack.append(t)
    out_accepting = [False] * len(order)
    out_transitions = [()] * len(order)
    for b, s in representative.items():
        i = order[b]
        out_accepting[i] = accepting[s]
        out_transitions[i] = _merge((lo, hi, order[block[t]]) for lo, hi, t in moves[s])
    return out_accepting, out_transitions


def _char(code: int) -> str:
    if 0x30 <= code <= 0x39 or 0x41 <= code <= 0x5a or 0x61 <= code <= 0x7a:
        return chr(code)
    # \x reads as many hex digits as follow; \u takes four, \U eight
    if code < 0x10000:
        return f'\\u{code:04x}'
    return f'\\U{code:08x}'


def _class(ranges) -> str:
    return '[' + ''.join(_char(lo) if lo == hi else f'{_char(lo)}-{_char(hi)}' for lo, hi in ranges) + ']'


def _rule_lines(accepting, transitions, names, options) -> list[str]:
    """Rules ``names[i] ::= ...``, one per state: ``""`` where the state accepts, then ``options(moves, names)``."""
    return [f'{names[i]} ::= ' + ' | '.join((['""'] if accepting[i] else []) + options(moves, names))
            for i, moves in enumerate(transitions)]


def _plain_options(moves, names) -> list[str]:
    """Each target's character ranges as one class, every character written as itself."""
    by_target: dict = {}
    for lo, hi, t in moves:
        by_target.setdefault(t, []).append((lo, hi))
    return [f'({_class(r)} {names[t]})' for t, r in by_target.items()]


def _print(accepting, transitions) -> str:
    names = ['root'] + [f's{i}' for i in range(1, len(accepting))]
    return '\n'.join(_rule_lines(accepting, transitions, names, _plain_options)) + '\n'


def _automaton(regex: str, *, loops_only: bool, max_nfa_states: int = MAX_NFA_STATES):
    """``(accepting, transitions)`` of the minimal deterministic automaton of ``xgr.Grammar.from_regex(regex)``, or
    None (rules this module does not read, too many states, an empty language; no loop when ``loops_only``)."""
    text = str(xgr.Grammar.from_regex(regex))
    try:
        rules = _rules(text, _Rules)
        if 'root' not in rules:
            return None
        nfa = _NFA(rules, max_nfa_states)
        final = nfa.state()
        start = nfa.build(('ref', 'root'), final)
        if loops_only and not nfa.loops:
            return None
        minimal = _minimize(*_determinize(nfa, start, final))
    except (_Unsupported, RecursionError):
        return None
    if minimal is None or len(minimal[0]) > MAX_DFA_STATES:
        return None
    return minimal


@functools.lru_cache(maxsize=256)
def deterministic_grammar(regex: str) -> str | None:
    """The EBNF text of a grammar, one rule per state of a minimal deterministic automaton, with the language of
    ``xgr.Grammar.from_regex(regex)``; None where this module leaves the regex to xgrammar (no loop, constructs it
    does not read, too many states, an empty language). Raises what ``from_regex`` raises for an invalid regex.

    Pseudocode::

        rules = parse(str(xgr.Grammar.from_regex(regex)))     # xgrammar's dialect, already resolved
        nfa = build(rules['root'], then=final)                 # right to left; tail self-reference = loop
        dfa = minimize(subsets(nfa))                           # transitions on disjoint code-point ranges
        return one rule per dfa state: "" if accepting | [ranges] next_state ...
    """
    # a literal or bounded repetitions (no loop): xgrammar's parser keeps a bounded state, and its grammar is smaller
    minimal = _automaton(regex, loops_only=True)
    return None if minimal is None else _print(*minimal)


#: Characters a probe writes: printable ASCII but the quote and the backslash (a JSON string writes those, and control
#: characters, as escapes, which xgrammar's pattern automaton reads differently), and a few beyond ASCII.
_PROBES = tuple(c for c in range(0x20, 0x7F) if c not in (0x22, 0x5C)) + (0xE9, 0x4E00, 0x1F600)


@functools.lru_cache(maxsize=1024)
def pattern_counterexample(pattern: str) -> str | None:
    """A string on which xgrammar's compile of a JSON-schema ``pattern`` and the pattern disagree, or None.

    xgrammar compiles a ``pattern`` of a JSON schema with its own regex automaton, which in xgrammar 0.2.8 is not
    exact for every pattern: ``^(0|1\\d*)(x\\d+)?$`` accepts ``"01"``. The reference is the minimal automaton of
    ``from_regex``'s rules of the pattern (both read a pattern as a whole-string match). From the shortest string of
    every state, each probe character must go on exactly when the state has a transition on it, and the string must
    end there exactly when the state accepts. None also where this module does not read the pattern (more than
    :data:`MAX_PROBED_NFA_STATES` or :data:`MAX_DFA_STATES` states, constructs it leaves to xgrammar) or xgrammar
    refuses it.
    """
    try:
        # a smaller automaton than for a compile: this runs where the request enters
        reference = _automaton(pattern, loops_only=False, max_nfa_states=MAX_PROBED_NFA_STATES)
        if reference is None:
            return None
        grammar = xgr.Grammar.from_json_schema(json.dumps({'type': 'string', 'pattern': pattern}))
    except RuntimeError:
        return None
    accepting, transitions = reference
    matcher = _get_matcher_from_grammar(grammar)

    def accepts(text: str, whole: bool) -> bool:
        matcher.reset()
        written = json.dumps(text, ensure_ascii=False)
        return matcher.accept_string(written if whole else written[:-1]) and (not whole or matcher.is_terminated())

    def target(state: int, code: int) -> int | None:
        for low, high, nxt in transitions[state]:
            if low <= code <= high:
                return nxt
        return None

    # the shortest string of every state reached through probe characters, in order of discovery
    shortest, order = {0: ''}, [0]
    for state in order:
        text = shortest[state]
        if accepts(text, True) != accepting[state]:
            return text
        for code in _PROBES:
            nxt = target(state, code)
            if accepts(text + chr(code), False) != (nxt is not None):
                return text + chr(code)
            if nxt is not None and nxt not in shortest:
                shortest[nxt] = text + chr(code)
                order.append(nxt)
    return None


#: The characters a JSON string cannot hold as themselves (control characters, the quote, the backslash), each with
#: the escape the exact grammar of a pattern writes for it: the short escape where JSON has one, else ``\u00XX``.
_JSON_ESCAPES = {0x22: '"', 0x5c: '\\', 0x08: 'b', 0x0c: 'f', 0x0a: 'n', 0x0d: 'r', 0x09: 't'}


def _json_escape(code: int) -> str:
    """The grammar of the escape of ``code`` (a control character, the quote or the backslash) in a JSON string."""
    short = _JSON_ESCAPES.get(code)
    if short is not None:
        return f'{_class([(0x5c, 0x5c)])} {_class([(ord(short), ord(short))])}'
    hex_digits = []
    for digit in f'{code:04x}':
        if digit.isdigit():
            hex_digits.append(f'[{digit}]')
        else:
            hex_digits.append(f'[{digit}{digit.upper()}]')
    return f'{_class([(0x5c, 0x5c)])} [u] ' + ' '.join(hex_digits)


def _json_string_options(moves, names) -> list[str]:
    """Each target's character ranges inside a JSON string: a character JSON must escape (a control character, the
    quote, the backslash) as its escape, every other character as itself."""
    raw: dict = {}
    escaped = []
    for lo, hi, t in moves:
        for a, b in ((lo, min(hi, 0x21)), (max(lo, 0x23), min(hi, 0x5b)), (max(lo, 0x5d), hi)):
            if a <= b and b >= 0x20:
                raw.setdefault(t, []).append((max(a, 0x20), b))
        escaped.extend((code, t) for code in range(lo, min(hi, 0x5c) + 1) if code < 0x20 or code in (0x22, 0x5c))
    return ([f'({_class(r)} {names[t]})' for t, r in raw.items()]
            + [f'({_json_escape(code)} {names[t]})' for code, t in escaped])


#: Keywords whose values are instances, not schemas: a ``pattern`` key inside them is data.
_INSTANCE_KEYWORDS = frozenset({'const', 'enum', 'default', 'examples'})
#: Keywords whose values map names (of properties, definitions, patterns) to schemas: a name is not a keyword.
_NAMED_SCHEMAS = frozenset({'properties', 'patternProperties', '$defs', 'definitions', 'dependentSchemas'})


def _with_patterns(schema, replace: dict, found: set | None = None):
    """A copy of ``schema`` with every pattern (a ``pattern`` value, a ``patternProperties`` key) found in ``replace``
    replaced by its value there; all patterns are added to ``found``. Instances (``const``, ``enum``...) stay as they
    are; names under ``properties``, ``$defs``... are names, not keywords."""
    if isinstance(schema, list):
        return [_with_patterns(node, replace, found) for node in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _INSTANCE_KEYWORDS:
            out[key] = value
        elif key == 'patternProperties' and isinstance(value, dict):
            # its keys are patterns too (xgrammar compiles a property name with its automaton)
            if found is not None:
                found.update(value)
            out[key] = {replace.get(name, name): _with_patterns(sub, replace, found) for name, sub in value.items()}
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _with_patterns(sub, replace, found) for name, sub in value.items()}
        else:
            out[key] = _with_patterns(value, replace, found)
    pattern = schema.get('pattern')
    if isinstance(pattern, str):
        if found is not None:
            found.add(pattern)
        out['pattern'] = replace.get(pattern, pattern)
    return out


def _schema_patterns(schema) -> set[str]:
    """The patterns of a JSON schema (``pattern`` values, ``patternProperties`` keys), wherever they are."""
    found: set[str] = set()
    _with_patterns(schema, {}, found)
    return found


def _strings(node, found: set) -> set:
    """Every string of a JSON document, keys included."""
    if isinstance(node, str):
        found.add(node)
    elif isinstance(node, list):
        for item in node:
            _strings(item, found)
    elif isinstance(node, dict):
        for key, value in node.items():
            found.add(key)
            _strings(value, found)
    return found


@functools.lru_cache(maxsize=1024)
def _regex_rule(pattern: str) -> str | None:
    """The right-hand side of the one rule xgrammar writes for ``pattern`` in a JSON schema's grammar with its regex
    automaton (``Regex("...", json_string=true)``), or None where it writes rules of its own (a pattern with
    characters beyond ASCII) or refuses the pattern (a ``\\p{...}`` class, an invalid regex)."""
    try:
        text = str(xgr.Grammar.from_json_schema(json.dumps({'type': 'string', 'pattern': pattern})))
    except RuntimeError:
        return None
    rules = [line.split(' ::= ', 1)[1] for line in text.splitlines() if ' ::= Regex(' in line]
    return rules[0] if len(rules) == 1 else None


@functools.lru_cache(maxsize=1024)
def exact_pattern_automaton(pattern: str):
    """``(accepting, transitions)`` of the minimal automaton of a JSON-schema ``pattern`` where xgrammar's compile of
    the pattern is not exact, else None (xgrammar's compile is kept).

    Not exact: a pattern xgrammar reads with its regex automaton where the automaton accepts a string the pattern does
    not (:func:`pattern_counterexample`), and a pattern xgrammar writes as rules of ``from_regex`` (characters beyond
    ASCII): those rules take the quote, the backslash and control characters as themselves inside the
    JSON string (``^.+é$`` accepts ``"a"é"``, not JSON) and, with nested quantifiers, cost more per token the
    longer the string. None also where the automaton has more than :data:`MAX_PROBED_NFA_STATES` or
    :data:`MAX_DFA_STATES` states, or constructs this module leaves to xgrammar.
    """
    try:
        automaton = _automaton(pattern, loops_only=False, max_nfa_states=MAX_PROBED_NFA_STATES)
    except RuntimeError:
        # an invalid pattern: xgrammar's compile of the schema says why
        return None
    if automaton is None:
        return None
    if _regex_rule(pattern) is None or pattern_counterexample(pattern) is not None:
        return automaton
    return None


# xgrammar 0.2.8's rule of the characters of a string with minLength or maxLength (``"\"" X{m,n} "\""``): it takes
# a raw tab or any other control character (JSON refuses them, so the output is not JSON) and no escape. Replaced by
# the characters a JSON string holds unescaped
_BOUNDED_CHARACTERS = r'(([^\"\\\r\n]))'
# (escapes as well, an alternative of the repeated rule, made a maxLength of 1000 compile for minutes instead of 7 s)
_JSON_CHARACTER = r'(([^\0-\x1f\"\\]))'


def _has_length_bounds(node) -> bool:
    """Whether a JSON schema has a ``minLength`` or ``maxLength`` anywhere (keys of its objects)."""
    if isinstance(node, list):
        return any(_has_length_bounds(item) for item in node)
    if isinstance(node, dict):
        return 'minLength' in node or 'maxLength' in node or any(_has_length_bounds(v) for v in node.values())
    return False


def exact_patterns_grammar(schema: str | dict, **options) -> str | None:
    """The EBNF text of ``xgr.Grammar.from_json_schema(schema, **options)`` with the rules of every ``pattern`` that
    xgrammar does not compile exactly (:func:`exact_pattern_automaton`) replaced by rules of the pattern's minimal
    deterministic automaton written inside a JSON string; None where no pattern needs it (compile the schema as
    xgrammar does).

    The rules accept a string exactly when its value matches the pattern (``from_regex``'s reading of it, a
    whole-string match, as xgrammar's), each character written as itself or, where JSON must escape it, with its
    short escape (``\\n``, ``\\"``) or ``\\u00XX`` (as ``json.dumps(..., ensure_ascii=False)`` writes them), one
    rule per state, so a mask costs the same however long the string. Each such pattern is swapped in the schema for
    a placeholder pattern whose rule xgrammar writes on one line, then that line is replaced.

    The characters of a string with ``minLength`` or ``maxLength`` are those a JSON string holds unescaped: any but a
    control character, a quote or a backslash (xgrammar's rule of them takes raw control characters, which make the
    output invalid JSON). Escapes stay out, as in xgrammar's rule.
    """
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        patterns = _schema_patterns(parsed)
        exact = {p: a for p in sorted(patterns) if (a := exact_pattern_automaton(p)) is not None}
        bounded = _has_length_bounds(parsed)
        if not exact and not bounded:
            return None
        # a placeholder no string of the schema spells (a patternProperties key compiles to such a rule too)
        taken = _strings(parsed, set())
        placeholders, rules = {}, {}
        for i, pattern in enumerate(exact):
            placeholder = f'^exactpattern{i}$'
            while placeholder in taken:
                placeholder = placeholder[:-1] + 'x$'
            placeholders[pattern] = placeholder
            rules[_regex_rule(placeholder)] = exact[pattern]
        rewritten = json.dumps(_with_patterns(parsed, placeholders))
    except (ValueError, RecursionError):
        # not JSON, or nested deeper than Python recurses: xgrammar's compile of it says what is wrong
        return None
    text = str(xgr.Grammar.from_json_schema(rewritten, **options))
    lines = text.splitlines()
    names = {line.split(' ::= ', 1)[0] for line in lines}
    out = []
    for line in lines:
        name, _, body = line.partition(' ::= ')
        if bounded and body == _BOUNDED_CHARACTERS and name.endswith('_characters'):
            out.append(f'{name} ::= {_JSON_CHARACTER}')
            continue
        automaton = rules.get(body)
        if automaton is None:
            out.append(line)
            continue
        accepting, transitions = automaton
        prefix = f'{name}_exact'
        while any(n.startswith(prefix) for n in names):
            prefix += '_'
        states = [name] + [f'{prefix}{i}' for i in range(1, len(accepting))]
        names.update(states)
        out.extend(_rule_lines(accepting, transitions, states, _json_string_options))
    # the text, once made, even where no rule changed: converting the schema again would cost the same again
    return '\n'.join(out) + '\n'


def compile_json_schema(compiler: xgr.GrammarCompiler, schema: str | dict, **options) -> xgr.CompiledGrammar:
    """``compiler.compile_json_schema(schema, **options)``, but with the rules of :func:`exact_patterns_grammar`
    where a pattern needs them."""
    ebnf = exact_patterns_grammar(schema, **options)
    if ebnf is None:
        return compiler.compile_json_schema(schema, **options)
    return compiler.compile_grammar(ebnf)


def compile_regex(compiler: xgr.GrammarCompiler, regex: str) -> xgr.CompiledGrammar:
    """``compiler.compile_regex(regex)``, but through :func:`deterministic_grammar` where it gives a grammar."""
    ebnf = deterministic_grammar(regex)
    if ebnf is None:
        return compiler.compile_regex(regex)
    return compiler.compile_grammar(ebnf)
