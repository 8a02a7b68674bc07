"""Stop strings: their limits and a matcher whose cost per step is the new text only.

Every stop string of a request goes into one Aho-Corasick automaton, built once
(and shared by requests with the same strings, such as the samples of an
``n > 1`` request). The matcher keeps its place in the automaton between steps,
so each step feeds only the characters decoded since the previous one: the
cost of a step depends neither on the text generated so far nor on the number
or length of the stop strings, nor on any other request. The automaton's state
also says how much of the end of the text could still grow into a stop string
(the part a stream holds back).

A match is the one that completes first in the text (the earliest end); of
those ending at the same character, the longest. This does not depend on how
the text was split into steps.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence

from backplane.core.errors import InvalidFieldError

__all__ = ["StopAutomaton", "StopMatcher", "check_stop_limits", "stop_automaton"]

# a trie edge is the key ``node << _CHAR_BITS | ord(char)`` (every code point fits in 21 bits)
_CHAR_BITS = 21


def check_stop_limits(stops: Sequence[str], max_count: int, max_length: int) -> None:
    """Refuse stop strings beyond the engine's limits.

    :param stops: the request's stop strings.
    :param max_count: the most stop strings one request may give (``max_stop_strings``).
    :param max_length: the most characters one stop string may have
        (``max_stop_string_length``).
    :raises InvalidFieldError: (``field="stop"``) too many strings, or one too long.
    """
    if len(stops) > max_count:
        raise InvalidFieldError(
            f"stop: {len(stops)} stop strings given, at most {max_count} are allowed; pass "
            "fewer (the server's limit is the engine setting max_stop_strings)",
            field="stop",
        )
    for i, s in enumerate(stops):
        if len(s) > max_length:
            raise InvalidFieldError(
                f"stop[{i}] has {len(s)} characters, at most {max_length} are allowed; pass a "
                "shorter stop string (the limit is the engine setting max_stop_string_length)",
                field="stop",
            )


class _Automaton:
    """The Aho-Corasick automaton of a set of stop strings.

    Node 0 is the root; ``depth[v]`` is the length of the prefix node ``v``
    spells and ``inner[v]`` whether ``v`` is a proper prefix of some stop
    string (has a child). The fail link of a node (its longest proper suffix in
    the trie) and its output (the longest stop string ending there) are worked
    out the first time the text reaches the node: building then costs one pass
    over the characters of the stop strings, in bulk where a string leaves the
    trie, and text that shares little with the stop strings never pays for the
    nodes it does not reach.

    :param stops: the stop strings (non-empty); the first of equal strings is reported.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        goto: dict[int, int] = {}
        depth = array("i", [0])
        parent = array("i", [0])
        char = array("i", [0])
        term = array("i", [-1])
        inner = bytearray(1)
        for idx, s in enumerate(stops):
            v, i = 0, 0
            while i < len(s):  # follow the part already in the trie
                nxt = goto.get(v << _CHAR_BITS | ord(s[i]))
                if nxt is None:
                    break
                v, i = nxt, i + 1
            if i < len(s):  # the rest is a new chain of nodes base, base + 1, ...
                base, rest = len(depth), len(s) - i
                codes = [ord(ch) for ch in s[i:]]
                parents = [v, *range(base, base + rest - 1)]
                goto.update(
                    zip(
                        [p << _CHAR_BITS | c for p, c in zip(parents, codes, strict=True)],
                        range(base, base + rest),
                        strict=True,
                    )
                )
                depth.extend(range(depth[v] + 1, depth[v] + 1 + rest))
                parent.extend(parents)
                char.extend(codes)
                term.extend([-1] * rest)
                inner[v] = 1
                inner.extend(b"\x01" * (rest - 1) + b"\x00")
                v = base + rest - 1
            if term[v] == -1:
                term[v] = idx
        n = len(depth)
        self.goto = goto
        self.depth = depth
        self.parent = parent
        self.char = char
        self.term = term
        self.inner = inner
        self.fail = array("i", [-1]) * n  # -1: not worked out yet
        self.fail[0] = 0
        self.out = array("i", [-2]) * n  # -2: not worked out yet; -1: none
        self.out[0] = -1
        self.longest = max(len(s) for s in stops)

    def fail_of(self, v: int) -> int:
        """The fail link of node ``v``, working out those it depends on first.

        :param v: a node.
        :return: the node of the longest proper suffix of ``v``'s prefix that is in the trie.
        """
        fail, parent, char, goto = self.fail, self.parent, self.char, self.goto
        stack = [v]
        while stack:
            u = stack[-1]
            if fail[u] >= 0:
                stack.pop()
                continue
            p = parent[u]
            if p == 0:
                fail[u] = 0
                stack.pop()
                continue
            f = fail[p]
            if f < 0:
                stack.append(p)  # shallower than u: the stack ends
                continue
            c = char[u]
            while True:
                nxt = goto.get(f << _CHAR_BITS | c)
                if nxt is not None:
                    fail[u] = nxt
                    break
                if f == 0:
                    fail[u] = 0
                    break
                g = fail[f]
                if g < 0:
                    stack.append(f)  # shallower than u; u is tried again after it
                    break
                f = g
            if fail[u] >= 0:
                stack.pop()
        return fail[v]

    def out_of(self, v: int) -> int:
        """The index of the longest stop string that ends at node ``v`` (-1: none).

        :param v: a node.
        :return: an index into :attr:`stops`, or -1.
        """
        out = self.out
        if out[v] != -2:
            return out[v]
        chain = []
        u = v
        while out[u] == -2:
            if self.term[u] != -1:
                out[u] = self.term[u]
                break
            chain.append(u)
            u = self.fail_of(u)
        for w in chain:
            out[w] = out[u]
        return out[v]


#: the matching automaton of one set of stop strings (build it with :func:`stop_automaton`)
StopAutomaton = _Automaton


@functools.lru_cache(maxsize=8)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """Build (or find) the automaton of ``stops``, shared by the requests that give the same strings.

    Building one for the largest allowed set takes a fraction of a second, so
    :class:`~backplane.api.async_llm.AsyncLLM` builds it on a worker thread
    before the request reaches the engine loop, where every stream would wait for it.

    :param stops: the request's stop strings (each non-empty).
    :return: the automaton to hand to :class:`StopMatcher`.
    """
    return _Automaton(stops)


class StopMatcher:
    """Finds a request's stop strings in its text as the text grows.

    Feed it the whole text after each step (:meth:`consume`); it reads only the
    characters it has not read before. Matches that end at or before the
    ``floor`` (the text of the first ``min_tokens`` tokens) do not count; the
    floor may be set after text was read (:meth:`set_floor`).

    :param stops: the request's stop strings (non-empty, each non-empty).
    :param automaton: their automaton, built ahead (:func:`stop_automaton`); built here if ``None``.
    """

    __slots__ = ("_ac", "_node", "_fed", "_floor", "_found", "_skip_to")

    def __init__(self, stops: tuple[str, ...], automaton: StopAutomaton | None = None) -> None:
        self._ac = automaton if automaton is not None else stop_automaton(stops)
        self._node = 0
        self._fed = 0  # characters of the text read so far
        self._floor: int | None = None  # None: not known yet (every match is kept)
        self._found: list[tuple[int, int]] = []  # (end, stop index), in order of end
        self._skip_to = 0  # matches ending here or before were recorded already

    @property
    def longest(self) -> int:
        """The length of the longest stop string."""
        return self._ac.longest

    @property
    def searching(self) -> bool:
        """Whether the floor is set (matches are being reported)."""
        return self._floor is not None

    def set_floor(self, floor: int) -> None:
        """Count only matches that end after character ``floor`` from now on.

        :param floor: the length of the text that may not end a match.
        """
        self._floor = floor
        self._found = [m for m in self._found if m[0] > floor][:1]

    def consume(self, text: str) -> None:
        """Read the characters of ``text`` not read yet.

        :param text: the request's text so far; it extends the text read before
            (see :meth:`rewind` for text that changed).
        """
        ac = self._ac
        goto, fail, out = ac.goto, ac.fail, ac.out
        fail_of, out_of = ac.fail_of, ac.out_of
        v = self._node
        floor = self._floor
        found = self._found
        if floor is not None and found:
            self._fed = len(text)  # the first match is known; the rest changes nothing
            return
        pos = self._fed
        for ch in text[pos:]:
            c = ord(ch)
            while True:
                nxt = goto.get(v << _CHAR_BITS | c)
                if nxt is not None:
                    v = nxt
                    break
                if v == 0:
                    break
                f = fail[v]
                v = f if f >= 0 else fail_of(v)
            pos += 1
            hit = out[v]
            if hit == -2:
                hit = out_of(v)
            if hit != -1 and pos > self._skip_to and (floor is None or pos > floor):
                found.append((pos, hit))
                if floor is not None:
                    break
        self._node = v
        self._fed = len(text) if floor is not None and found else pos

    def rewind(self, common: int) -> None:
        """The text changed after its first ``common`` characters: read it again from there.

        The automaton restarts ``longest - 1`` characters earlier, so a match
        may begin in the unchanged text; matches ending in it are not reported twice.

        :param common: the length of the part of the text that did not change.
        """
        if common >= self._fed:
            return
        self._found = [m for m in self._found if m[0] <= common]
        self._skip_to = max(self._skip_to, common)
        self._fed = max(0, common - (self._ac.longest - 1))
        self._node = 0

    def match(self) -> tuple[int, str] | None:
        """The first match ending after the floor, once the floor is set.

        :return: ``(start, stop string)``, or ``None``.
        """
        if self._floor is None:
            return None
        for end, idx in self._found:
            if end > self._floor:
                s = self._ac.stops[idx]
                return end - len(s), s
        return None

    def partial(self) -> int:
        """How many characters at the end of the text read could begin a stop string.

        :return: the length of the longest end of the text that is a proper
            prefix of some stop string (0 when none is).
        """
        ac = self._ac
        v = self._node
        while v and not ac.inner[v]:
            v = ac.fail_of(v)
        return ac.depth[v]
