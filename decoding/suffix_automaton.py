"""The suffix automaton of a token text, the data structure of SAM-Decoding (Hu et al. 2024, "SAM Decoding:
Speculative Decoding via Suffix Automaton"); ``methods/samd.py`` drafts with it.

The suffix automaton (Blumer et al. 1985) of a text is the smallest automaton that accepts exactly its
substrings: every substring is a path of transitions from state 0 (the empty string). A state holds the
substrings that end at the same set of positions; ``length[s]`` is the longest of them, and ``link[s]`` (the
suffix link) is the state of the longest suffix that ends at more positions. It has at most ``2 n`` states and
``3 n`` transitions, and :meth:`SuffixAutomaton.append` adds one token in amortized O(1) (the classic online
construction), so the automaton of a prompt grows with the text as tokens are committed, never rebuilt.

SAM-Decoding keeps, beside the automaton, a *cursor*: the longest suffix of the text read so far that occurs in
the automaton's text (state and length). Moving it by one token (:meth:`SuffixAutomaton.step`) is amortized O(1)
too. Each state also keeps ``first_end[s]``, where its substrings first end in the text: the continuation after
that first occurrence is the draft (the authors' ``min_endpos``).

A corpus automaton (the authors' "static" SAM) holds several documents with a separator between them
(:meth:`SuffixAutomaton.add_document`); no match crosses one and continuations stop at it. ``counts()`` gives how
often each state's substrings occur, which ranks its transitions (:meth:`SuffixAutomaton.top_next`).
"""

from __future__ import annotations

SEP = -1  # between documents: never a token, so no match contains it


class SuffixAutomaton:
    """The suffix automaton of ``tokens`` (a list of token ids), extended in place.

    Per state ``s``: ``next[s]`` (``{token: state}``), ``link[s]``, ``length[s]`` and ``first_end[s]`` (an index into
    :attr:`tokens`: the last token of the state's first occurrence; -1 for the root). State 0 is the root.
    """

    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first_end: list[int] = [-1]
        self.last = 0  # the state of the whole text
        self._counts: list[int] | None = None
        self._top: dict[int, list[tuple[int, int]]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def states(self) -> int:
        return len(self.length)

    def _new_state(self, length: int, link: int, first_end: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        """Add one token at the end of the text (amortized O(1): the online construction of Blumer et al.)."""
        token = int(token)
        self.tokens.append(token)
        self._counts, self._top = None, {}
        end = len(self.tokens) - 1
        cur = self._new_state(self.length[self.last] + 1, 0, end, {})
        p = self.last
        # Every suffix of the old text without a `token` transition now gains one, to the new state.
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                # q holds strings longer than suffix(p) + token: split off the shorter ones into a clone, which
                # first ends where q first ends (the new position is the latest).
                clone = self._new_state(self.length[p] + 1, self.link[q], self.first_end[q], dict(self.next[q]))
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def extend(self, tokens) -> None:
        for token in tokens:
            self.append(token)

    def add_document(self, tokens) -> None:
        """Append a separator (unless the text is empty), then ``tokens``: a corpus of several documents."""
        if self.tokens:
            self.append(SEP)
        self.extend(tokens)

    # ------------------------------------------------------------------------------------------ matching

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        """The cursor after reading ``token``: from the longest suffix ``(state, length)`` of what was read that
        occurs in the text, the longest suffix of it + ``token`` that occurs; ``(0, 0)``: none (amortized O(1))."""
        # After a clone split ``state``, its shorter strings live in an ancestor: move there first, so the
        # fall-back below never overstates the length.
        while state and length <= self.length[self.link[state]]:
            state = self.link[state]
        while state and token not in self.next[state]:
            state = self.link[state]
            length = self.length[state]
        if token in self.next[state]:
            return self.next[state][token], length + 1
        return 0, 0

    def match(self, tokens, state: int = 0, length: int = 0) -> tuple[int, int]:
        """The cursor after reading ``tokens`` from ``(state, length)``: the longest suffix of them that occurs."""
        for token in tokens:
            state, length = self.step(state, length, token)
        return state, length

    def continuation(self, state: int, n: int) -> list[int]:
        """Up to ``n`` tokens after ``state``'s first occurrence in the text, stopped at a separator."""
        start = self.first_end[state] + 1
        out = self.tokens[start:start + n]
        return out[: out.index(SEP)] if SEP in out else out

    def earlier(self, state: int, want: int) -> int:
        """From ``state``, follow suffix links (shorter matches, which may first occur earlier) until its first
        occurrence has ``want`` tokens after it or the next link is the root (the authors' ``to_anc``)."""
        end = len(self.tokens) - 1
        while state and self.link[state] != 0 and end - self.first_end[state] < want:
            state = self.link[state]
        return state

    # ------------------------------------------------------------------------------------ corpus statistics

    def counts(self) -> list[int]:
        """``counts()[s]``: at how many positions the strings of state ``s`` end (its occurrences); O(states)."""
        if self._counts is None:
            cnt = [0] * self.states
            # Each prefix of the text ends once, at its own state (the one append made for it); clones hold
            # no end of their own but inherit those of every state whose suffix link leads to them.
            s = 0
            for token in self.tokens:
                s = self.next[s][token]
                cnt[s] += 1
            for s in sorted(range(1, self.states), key=self.length.__getitem__, reverse=True):
                cnt[self.link[s]] += cnt[s]
            self._counts = cnt
        return self._counts

    def top_next(self, state: int, k: int) -> list[tuple[int, int]]:
        """The ``k`` transitions ``(token, state)`` out of ``state`` whose strings occur most often."""
        if state not in self._top:
            cnt = self.counts()
            self._top[state] = sorted(self.next[state].items(), key=lambda item: -cnt[item[1]])
        return self._top[state][:k]
