"""How a request lays out its JSON: the whitespace it writes at each grammatical place.

Under any-whitespace JSON grammars (lmdeploy's default) optional whitespace may follow every structural character,
so the grammar forces almost nothing. A model still writes one consistent style: a newline and an indentation after
``{`` and ``,``, a space after ``:``, nothing before ``,``. :class:`JsonLayout` reads output text byte by byte and
names the place of every whitespace run (the structural character before it, the bracket depth, the character after
it); :class:`WhitespaceMemory` remembers what was written at each place and predicts it for the next time.
"""
from __future__ import annotations

from collections import Counter, defaultdict

__all__ = ['WHITESPACE', 'JsonLayout', 'WhitespaceMemory', 'Place']

#: The bytes of JSON whitespace.
WHITESPACE = frozenset(b' \n\t\r')
_OPEN = frozenset(b'{[')
_CLOSE = frozenset(b'}]')
_ITEM_START = frozenset(b'{[,')
#: Where a value ends: the place before ``,``, ``}``, ``]`` and ``:`` after a value or key.
VALUE = ord('v')
#: The start of the output.
START = ord('^')

#: ``(byte before the run, bracket depth, byte after the run)``; the byte before is a structural character, VALUE or
#: START.
Place = tuple[int, int, int]


class JsonLayout:
    """A lexer over output bytes: in a string or not, bracket depth, the place of the whitespace run being written.

    It knows JSON's strings and brackets only; for other text (a regex grammar) its places are merely less useful.
    """

    __slots__ = ('in_string', 'escape', 'depth', 'last', 'run')

    def __init__(self):
        self.in_string = False
        self.escape = False
        self.depth = 0
        self.last = START
        # whitespace written since the last byte that is not whitespace (outside strings)
        self.run = b''

    def copy(self) -> JsonLayout:
        """An independent copy (for drafting ahead)."""
        other = JsonLayout.__new__(JsonLayout)
        other.in_string, other.escape, other.depth, other.last, other.run = (self.in_string, self.escape, self.depth,
                                                                               self.last, self.run)
        return other

    def feed(self, data: bytes, memory: WhitespaceMemory | None = None) -> None:
        """Read ``data``; every whitespace run it ends (possibly empty) is recorded in ``memory``."""
        for byte in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif byte == 0x5C:  # backslash
                    self.escape = True
                elif byte == 0x22:  # closing quote
                    self.in_string = False
                    self.last = VALUE
                continue
            if byte in WHITESPACE:
                self.run += bytes((byte, ))
                continue
            if memory is not None:
                memory.observe((self.last, self.depth, byte), self.run)
            self.run = b''
            if byte == 0x22:
                self.in_string = True
            elif byte in _OPEN:
                self.depth += 1
                self.last = byte
            elif byte in _CLOSE:
                self.depth = max(0, self.depth - 1)
                self.last = VALUE
            elif byte in b',:':
                self.last = byte
            else:
                self.last = VALUE


def _kind(before: int, after: int) -> tuple[int, int]:
    """The kind of a place: ``{``, ``[`` and ``,`` all start an item, ``}`` and ``]`` both close one."""
    return 0x7B if before in _ITEM_START else before, 0x7D if after in _CLOSE else after


def _level(place: Place) -> int:
    """Indentation level of a place: its depth, one less before a closing bracket."""
    _, depth, after = place
    return depth - (after in _CLOSE)


def _unit(place: Place, run: bytes) -> bytes | None:
    """The indentation unit of a run ``'\\n' + unit * level``, or None when the run is no such indentation."""
    level = _level(place)
    if not run.startswith(b'\n') or level <= 0:
        return None
    indent = run[1:]
    if not indent or len(indent) % level:
        return None
    unit = indent[:len(indent) // level]
    return unit if unit * level == indent else None


class WhitespaceMemory:
    """Whitespace runs written at each place: the latest run per place, and counts per place kind.

    ``fallback`` is consulted when this memory knows nothing of a place kind (an engine-wide memory behind a
    request's own).
    """

    def __init__(self, fallback: WhitespaceMemory | None = None):
        self.fallback = fallback
        self._latest: dict[Place, bytes] = {}
        # (kind of before, after) -> Counter of runs written, indentation turned into its unit as ('unit', unit)
        self._kinds: dict[tuple[int, int], Counter] = defaultdict(Counter)
        # before -> Counter of runs written whatever came after (for places where several values may follow)
        self._before: dict[int, Counter] = defaultdict(Counter)
        # kind of before -> Counter of the bytes written after its run
        self._after: dict[int, Counter] = defaultdict(Counter)

    def observe(self, place: Place, run: bytes) -> None:
        """Record that ``run`` was written at ``place``."""
        unit = _unit(place, run)
        key = ('unit', unit) if unit is not None else ('run', run)
        kind = _kind(place[0], place[2])
        memory = self
        while memory is not None:  # this memory, then its fallbacks (an engine-wide memory)
            memory._latest[place] = run
            memory._kinds[kind][key] += 1
            memory._before[place[0]][key] += 1
            memory._after[kind[0]][place[2]] += 1
            memory = memory.fallback

    def likely_after(self, before: int, candidates: set[int] | frozenset[int]) -> int | None:
        """Of ``candidates`` (bytes the grammar allows after a whitespace run that follows ``before``), the one
        written most often after this kind of place; the fallback memory's if this one never saw any of them."""
        counts = self._after.get(_kind(before, 0)[0])
        if counts:
            found = max(candidates, key=lambda byte: (counts.get(byte, 0), -byte))
            if counts.get(found, 0):
                return found
        if self.fallback is not None:
            return self.fallback.likely_after(before, candidates)
        return None

    @staticmethod
    def _render(key: tuple[str, bytes], place: Place) -> bytes:
        kind, value = key
        if kind == 'run':
            return value
        return b'\n' + value * _level(place)

    def predict(self, before: int, depth: int, after: int | None) -> bytes | None:
        """The whitespace to write between ``before`` and ``after`` at ``depth``, or None if unknown.

        ``after`` None: any of several bytes may follow, so only a choice written the same way whatever followed
        ``before`` is predicted. The latest run at the same place wins, then the most common choice at the same kind
        of place at any depth (indentation scaled to this depth; see :func:`_kind`), then the fallback memory.
        """
        if after is not None:
            run = self._latest.get((before, depth, after))
            if run is not None:
                return run
            counts = self._kinds.get(_kind(before, after))
            place = (before, depth, after)
        else:
            counts = self._before.get(before)
            if counts is not None and len(counts) > 1:
                return None
            place = (before, depth, 0)
        if counts:
            return self._render(counts.most_common(1)[0][0], place)
        if self.fallback is not None:
            return self.fallback.predict(before, depth, after)
        return None
