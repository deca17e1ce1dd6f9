"""Constrained decoding to one JSON object with given keys, in order (``--fields a,b``).

The reply is held to this grammar over UTF-8 bytes (RFC 8259 for strings and numbers)::

    object := "{" ws KEY_0 ws ":" ws value ws ( "," ws KEY_i ws ":" ws value ws )* "}"
    value  := string | number | "true" | "false" | "null" | array
    array  := "[" ws "]" | "[" ws scalar ws ( "," ws scalar ws )* "]"
    scalar := string | number | "true" | "false" | "null"
    ws     := at most MAX_WS bytes of space, \\n, \\r, \\t

``KEY_i`` is ``json.dumps(key, ensure_ascii=False)``: every key exactly once, in the given
order, nothing else. Values are strings, numbers, ``true``/``false``/``null`` or flat arrays
of those (no nested objects). Strings take the JSON escapes (``\\" \\\\ \\/ \\b \\f \\n \\r \\t
\\uXXXX``), no raw control bytes, and only well-formed UTF-8 (the ranges of the Unicode
Standard's table 3-7), so the finished reply always decodes and ``json.loads`` parses it.

Three parts:

* :class:`JsonObjectGrammar` — the byte automaton: states are small tuples, ``step(state,
  byte)`` gives the next state or ``None``; ``closing_bytes(state)`` the fewest bytes that
  finish the object from there.
* :class:`GrammarMasks` — the grammar against a vocabulary (:func:`engine.text.token_bytes`):
  the tokens allowed in a state, computed once per state and cached. Inside a string, the
  tokens made only of ordinary string bytes (well-formed UTF-8, no ``"``, ``\\`` or control
  byte) leave the state as it is; they form one precomputed mask, and only the other few
  thousand tokens are run through the automaton. Elsewhere only the tokens whose first
  byte the state takes are run.
* :class:`JsonConstraint` — one request's position in the grammar: the mask of its next
  token given the tokens it may still generate, and :meth:`JsonConstraint.advance`.

The token budget: a token is allowed only if the object can still be finished in the
tokens left after it (``closing_bytes`` counts bytes, and every byte is one token in a
byte-level vocabulary, so it is an upper bound there). A reply therefore closes its object
within ``max_tokens`` whenever ``max_tokens`` is at least ``closing_bytes`` of the start
(the keys' punctuation plus one byte per value); below that the budget is ignored and the
object is cut (the runner then reports the parse error, never a parse). The object's
closing ``}`` ends the job (finish reason ``stop``).
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_WS = 8  # whitespace bytes in one gap: room for pretty-printing, no endless newlines
WS = frozenset(b" \n\r\t")
HEX = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")
ESCAPES = frozenset(b'"\\/bfnrt')
WORDS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}

# Items of the object's grammar.
LIT, GAP, VALUE = "lit", "ws", "value"
# Scalar states: ("str", sub) sub = 0 (plain), "esc" (after \\), ("u", n) (n hex digits
# to go), ("cont", n, lo, hi) (n UTF-8 continuation bytes to go, the next in [lo, hi]);
# ("num", phase); ("word", word, consumed); DONE (a closed string).
DONE = ("done",)
STRING_PLAIN = ("str", 0)
# Number phases that end a complete number.
NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})


def _utf8_lead(b: int) -> tuple | None:
    """UTF-8 lead byte -> ("cont", continuation bytes, lo, hi of the next byte); the
    ranges of the Unicode Standard, table 3-7 (no overlongs, surrogates or > U+10FFFF)."""
    if 0xC2 <= b <= 0xDF:
        return ("cont", 1, 0x80, 0xBF)
    if b == 0xE0:
        return ("cont", 2, 0xA0, 0xBF)
    if 0xE1 <= b <= 0xEC or b in (0xEE, 0xEF):
        return ("cont", 2, 0x80, 0xBF)
    if b == 0xED:
        return ("cont", 2, 0x80, 0x9F)
    if b == 0xF0:
        return ("cont", 3, 0x90, 0xBF)
    if 0xF1 <= b <= 0xF3:
        return ("cont", 3, 0x80, 0xBF)
    if b == 0xF4:
        return ("cont", 3, 0x80, 0x8F)
    return None


def scalar_start(b: int) -> tuple | None:
    """The scalar state after its first byte ``b``, or ``None``."""
    if b == ord('"'):
        return STRING_PLAIN
    if b == ord("-"):
        return ("num", "minus")
    if b == ord("0"):
        return ("num", "zero")
    if b in DIGITS:
        return ("num", "int")
    if b in WORDS:
        return ("word", WORDS[b], 1)
    return None


def scalar_step(s: tuple, b: int) -> tuple | None:
    """The scalar state after byte ``b`` (``None``: ``b`` cannot continue the scalar)."""
    kind = s[0]
    if kind == "str":
        return _string_step(s[1], b)
    if kind == "num":
        return _number_step(s[1], b)
    if kind == "word":
        word, n = s[1], s[2]
        return ("word", word, n + 1) if n < len(word) and word[n] == b else None
    return None  # DONE


def _string_step(sub, b: int) -> tuple | None:
    if sub == 0:
        if b == ord('"'):
            return DONE
        if b == ord("\\"):
            return ("str", "esc")
        if b < 0x20:
            return None  # raw control bytes are not allowed in a JSON string
        if b < 0x80:
            return STRING_PLAIN
        lead = _utf8_lead(b)
        return ("str", lead) if lead else None
    if sub == "esc":
        if b == ord("u"):
            return ("str", ("u", 4))
        return STRING_PLAIN if b in ESCAPES else None
    if sub[0] == "u":
        if b not in HEX:
            return None
        return STRING_PLAIN if sub[1] == 1 else ("str", ("u", sub[1] - 1))
    _, n, lo, hi = sub  # a UTF-8 continuation byte
    if not lo <= b <= hi:
        return None
    return STRING_PLAIN if n == 1 else ("str", ("cont", n - 1, 0x80, 0xBF))


_NUMBER_MOVES = {  # phase -> (byte class, next phase) pairs
    "minus": (("0", "zero"), ("19", "int")),
    "zero": ((".", "dot"), ("eE", "e")),
    "int": (("09", "int"), (".", "dot"), ("eE", "e")),
    "dot": (("09", "frac"),),
    "frac": (("09", "frac"), ("eE", "e")),
    "e": (("+-", "sign"), ("09", "exp")),
    "sign": (("09", "exp"),),
    "exp": (("09", "exp"),),
}


def _in_class(b: int, cls: str) -> bool:
    if cls in ("09", "19"):
        return ord(cls[0]) <= b <= ord("9")
    return chr(b) in cls


def _number_step(phase: str, b: int) -> tuple | None:
    for cls, nxt in _NUMBER_MOVES[phase]:
        if _in_class(b, cls):
            return ("num", nxt)
    return None


def scalar_complete(s: tuple) -> bool:
    """Whether the scalar may end here."""
    if s[0] == "num":
        return s[1] in NUMBER_ENDS
    if s[0] == "word":
        return s[2] == len(s[1])
    return s == DONE


def scalar_closing(s: tuple) -> int:
    """Fewest bytes that complete the scalar."""
    kind = s[0]
    if kind == "str":
        sub = s[1]
        if sub == 0:
            return 1
        if sub == "esc":
            return 2
        return sub[1] + 1  # hex digits or continuation bytes, then the quote
    if kind == "num":
        return 0 if s[1] in NUMBER_ENDS else 1
    if kind == "word":
        return len(s[1]) - s[2]
    return 0


# Value states: a scalar state, or ("arr", phase, x): phase "open" / "after" / "comma"
# (x = whitespace bytes so far), "elem" (x = the element's scalar state), "closed".
def value_start(b: int) -> tuple | None:
    if b == ord("["):
        return ("arr", "open", 0)
    return scalar_start(b)


def value_step(v: tuple, b: int) -> tuple | None:
    if v[0] != "arr":
        return scalar_step(v, b)
    phase, x = v[1], v[2]
    if phase == "elem":
        inner = scalar_step(x, b)
        if inner is not None:
            return ("arr", "elem", inner)
        if not scalar_complete(x):
            return None
        phase, x = "after", 0  # the element ended: b belongs to what follows it
    if phase == "closed":
        return None
    if b in WS:
        return ("arr", phase, x + 1) if x < MAX_WS else None
    if b == ord("]") and phase in ("open", "after"):
        return ("arr", "closed", 0)
    if b == ord(",") and phase == "after":
        return ("arr", "comma", 0)
    if phase in ("open", "comma"):
        inner = scalar_start(b)
        return ("arr", "elem", inner) if inner is not None else None
    return None


def value_complete(v: tuple) -> bool:
    return v == ("arr", "closed", 0) if v[0] == "arr" else scalar_complete(v)


def value_closing(v: tuple) -> int:
    if v[0] != "arr":
        return scalar_closing(v)
    phase, x = v[1], v[2]
    if phase == "closed":
        return 0
    if phase == "elem":
        return scalar_closing(x) + 1
    return 2 if phase == "comma" else 1  # a "0" then "]" after a comma


def in_plain_string(v: tuple | None) -> bool:
    """Whether the value state is inside a string between characters (where ordinary
    string bytes keep the state unchanged)."""
    if v is None:
        return False
    return v == STRING_PLAIN or (v[0] == "arr" and v[1] == "elem" and v[2] == STRING_PLAIN)


class JsonObjectGrammar:
    """The byte automaton of one JSON object with exactly ``keys``, in order.

    A state is ``(item, sub)``: ``item`` indexes :attr:`items` (``(LIT, bytes)``,
    ``(GAP,)`` or ``(VALUE,)``), ``sub`` the position inside it (bytes of a literal
    matched, whitespace bytes of a gap, the value's state or ``None`` before it).
    ``(len(items), 0)`` is the accepting state: the object is complete.

    Parameters
    ----------
    keys
        Field names (at least one; each a non-empty string).

    Raises
    ------
    ValueError
        No keys, an empty or repeated key.
    """

    def __init__(self, keys: Sequence[str]):
        keys = tuple(keys)
        if not keys or any(not isinstance(k, str) or not k for k in keys):
            raise ValueError(f"a JSON object needs non-empty string keys, got {keys!r}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"repeated key in {keys!r}")
        self.keys = keys
        items: list[tuple] = [(LIT, b"{"), (GAP,)]
        for i, key in enumerate(keys):
            if i:
                items += [(LIT, b","), (GAP,)]
            quoted = json.dumps(key, ensure_ascii=False).encode("utf-8")
            items += [(LIT, quoted), (GAP,), (LIT, b":"), (GAP,), (VALUE,), (GAP,)]
        items.append((LIT, b"}"))
        self.items = tuple(items)
        self.start = (0, 0)
        self.accept = (len(items), 0)
        least = [len(it[1]) if it[0] == LIT else int(it[0] == VALUE) for it in items]
        self._suffix = [sum(least[i:]) for i in range(len(items) + 1)]

    def _entry(self, i: int) -> tuple:
        """The state at the start of item ``i``."""
        return (i, None) if i < len(self.items) and self.items[i][0] == VALUE else (i, 0)

    def step(self, state: tuple, b: int) -> tuple | None:
        """The state after byte ``b`` (an int 0-255), or ``None`` if the grammar forbids it."""
        i, sub = state
        while i < len(self.items):
            item = self.items[i]
            if item[0] == LIT:
                if item[1][sub] != b:
                    return None
                return (i, sub + 1) if sub + 1 < len(item[1]) else self._entry(i + 1)
            if item[0] == GAP:
                if b in WS and sub < MAX_WS:
                    return (i, sub + 1)
                i, sub = self._entry(i + 1)
                continue
            if sub is None:
                v = value_start(b)
                return (i, v) if v is not None else None
            v = value_step(sub, b)
            if v is not None:
                return (i, v)
            if not value_complete(sub):
                return None
            i, sub = self._entry(i + 1)
        return None

    def run(self, state: tuple, data: bytes) -> tuple | None:
        """The state after all of ``data``, or ``None``."""
        for b in data:
            state = self.step(state, b)
            if state is None:
                return None
        return state

    def closing_bytes(self, state: tuple) -> int:
        """Fewest bytes from ``state`` to the end of the object (0 when accepted)."""
        i, sub = state
        if i >= len(self.items):
            return 0
        item = self.items[i]
        if item[0] == LIT:
            here = len(item[1]) - sub
        elif item[0] == GAP:
            here = 0
        else:
            here = 1 if sub is None else value_closing(sub)
        return here + self._suffix[i + 1]

    def in_plain_string(self, state: tuple) -> bool:
        """Whether ``state`` is between characters of a string value (or array element)."""
        i, sub = state
        return i < len(self.items) and self.items[i][0] == VALUE and in_plain_string(sub)


def plain_string_token(data: bytes) -> bool:
    """Whether a token's bytes keep a string's plain state unchanged: well-formed UTF-8
    without ``"``, ``\\`` or a control byte (below 0x20)."""
    if not data or b'"' in data or b"\\" in data or min(data) < 0x20:
        return False
    state = STRING_PLAIN
    for b in data:
        state = _string_step(state[1], b)
        if state is None:
            return False
    return state == STRING_PLAIN


@dataclass(frozen=True)
class _StateMasks:
    """What one grammar state allows: the tokens run through the automaton with the
    closing bytes after each (``ids``, ``closing`` int64 ``[n]``); ``plain`` whether the
    vocabulary's plain-string tokens are allowed too (each leaves the state, hence its
    closing bytes ``here``, unchanged), and then ``dense``, the whole bool ``[V]`` mask
    (kept only for these few states; the others' masks are built from ``ids`` when asked,
    so the cache holds ``n`` ids per state rather than ``V`` bytes)."""

    dense: torch.Tensor | None
    ids: torch.Tensor
    closing: torch.Tensor
    plain: bool
    here: int
    most: int  # the largest closing bytes after any allowed token
    empty: bool  # no token is allowed at all


class _SortedTokens:
    """Token ids in byte order: an implicit trie (tokens sharing a prefix are adjacent)."""

    def __init__(self, ids: list[int], data: list[bytes]):
        order = sorted(range(len(ids)), key=data.__getitem__)
        self.ids = [ids[k] for k in order]
        self.data = [data[k] for k in order]

    def after_prefix(self, prefix: bytes, lo: int) -> int:
        """Index of the first token (from ``lo``) that does not start with ``prefix``."""
        head = prefix.rstrip(b"\xff")
        if not head:
            return len(self.data)
        upper = head[:-1] + bytes([head[-1] + 1])
        return bisect.bisect_left(self.data, upper, lo)


class TokenVocabulary:
    """A vocabulary as bytes, indexed for :class:`GrammarMasks`.

    Parameters
    ----------
    token_bytes
        ``V`` entries, the bytes of each id or ``None`` (never allowed: added / special
        tokens, undefined ids; empty tokens are treated the same).
    """

    def __init__(self, token_bytes: Sequence[bytes | None]):
        self.size = len(token_bytes)
        self.bytes: list[bytes | None] = [t if t else None for t in token_bytes]
        every: list[int] = []
        plain: list[int] = []  # ids whose bytes leave a string's plain state unchanged
        not_plain: list[int] = []  # ids that may still be valid inside a string
        for i, t in enumerate(self.bytes):
            if t is None:
                continue
            every.append(i)
            (plain if plain_string_token(t) else not_plain).append(i)
        self.plain = torch.zeros(self.size, dtype=torch.bool)
        self.plain[torch.tensor(plain, dtype=torch.long)] = True
        self.every = _SortedTokens(every, [self.bytes[i] for i in every])
        self.not_plain = _SortedTokens(not_plain, [self.bytes[i] for i in not_plain])


class GrammarMasks:
    """Per-state allowed-token masks of ``grammar`` over ``vocab``, cached (at most
    ``max_states`` states, least recently used dropped).

    Cost: a state seen before is a dictionary look-up; a new state walks the automaton
    down the vocabulary's implicit trie (tokens in byte order; a prefix the grammar refuses
    skips every token under it), inside a string only over the tokens that are not plain
    string text. See docs/performance.md.
    """

    def __init__(self, grammar: JsonObjectGrammar, vocab: TokenVocabulary, max_states: int = 512):
        self.grammar, self.vocab = grammar, vocab
        self.max_states = max_states
        self._cache: OrderedDict[tuple, _StateMasks] = OrderedDict()
        self.computed = 0  # states whose masks were built (cache misses)

    def masks(self, state: tuple) -> _StateMasks:
        """The cached masks of ``state`` (built on first use)."""
        found = self._cache.get(state)
        if found is not None:
            self._cache.move_to_end(state)
            return found
        found = self._build(state)
        self._cache[state] = found
        if len(self._cache) > self.max_states:
            self._cache.popitem(last=False)
        return found

    def _build(self, state: tuple) -> _StateMasks:
        self.computed += 1
        g, vocab = self.grammar, self.vocab
        plain = g.in_plain_string(state)
        ids, closing = self._walk(state, vocab.not_plain if plain else vocab.every)
        here = g.closing_bytes(state)
        ids_t = torch.tensor(ids, dtype=torch.long)
        dense = None
        if plain:
            dense = vocab.plain.clone()
            dense[ids_t] = True
        closing_t = torch.tensor(closing, dtype=torch.long)
        most = max(closing + ([here] if plain else []), default=0)
        empty = not ids and not (plain and bool(vocab.plain.any()))
        return _StateMasks(dense, ids_t, closing_t, plain, here, most, empty)

    def _walk(self, state: tuple, tokens: _SortedTokens) -> tuple[list[int], list[int]]:
        """The ids of ``tokens`` the grammar takes from ``state`` and the closing bytes
        after each: a depth-first walk of the implicit trie, reusing the states of the
        prefix shared with the previous token."""
        g, data = self.grammar, tokens.data
        ids, closing = [], []
        path = [state]  # path[d]: the state after the first d bytes of ``prev``
        prev = b""
        i, n = 0, len(data)
        while i < n:
            t = data[i]
            shared, most = 0, min(len(prev), len(t), len(path) - 1)
            while shared < most and prev[shared] == t[shared]:
                shared += 1
            del path[shared + 1 :]
            s = path[shared]
            for d in range(shared, len(t)):
                s = g.step(s, t[d])
                if s is None:  # no token under t[: d + 1] is allowed
                    i, prev = tokens.after_prefix(t[: d + 1], i + 1), t[:d]
                    break
                path.append(s)
            else:
                ids.append(tokens.ids[i])
                closing.append(g.closing_bytes(s))
                i, prev = i + 1, t
        return ids, closing

    def allowed(self, state: tuple, tokens_left: int) -> torch.Tensor:
        """Bool ``[V]``: the tokens allowed next in ``state`` when ``tokens_left`` tokens
        (this one included) may still be generated: those after which the object can be
        finished in ``tokens_left - 1`` tokens. Where no token can (a budget below the
        object's closing bytes) the budget is ignored. The tensor may be shared with the
        cache: read it, do not write to it."""
        m = self.masks(state)
        room = tokens_left - 1
        if m.most <= room:
            return m.dense if m.dense is not None else self._mask_of(m.ids)
        if m.plain and m.here <= room:
            mask = self.vocab.plain.clone()
            mask[m.ids[m.closing <= room]] = True
            return mask
        picked = m.ids[m.closing <= room]
        if picked.numel() == 0:  # the budget cannot be met: ignored
            return m.dense if m.dense is not None else self._mask_of(m.ids)
        return self._mask_of(picked)

    def _mask_of(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(self.vocab.size, dtype=torch.bool)
        mask[ids] = True
        return mask


class JsonConstraint:
    """One request's reply held to a :class:`JsonObjectGrammar` (through shared
    :class:`GrammarMasks`).

    ``state`` becomes ``None`` (nothing enforced from then on, :attr:`done` stays false,
    :attr:`gave_up` says why) when a token outside the grammar is fed (a caller that did
    not apply the mask) or when no token of the vocabulary can continue (a key character
    the vocabulary cannot spell): the reply is then only validated afterwards.
    """

    def __init__(self, masks: GrammarMasks):
        self.masks = masks
        self.state: tuple | None = masks.grammar.start
        self.gave_up = ""

    @property
    def done(self) -> bool:
        """Whether the object is complete (its closing ``}`` was generated)."""
        return self.state == self.masks.grammar.accept

    def allowed(self, tokens_left: int) -> torch.Tensor | None:
        """Bool ``[V]`` of the next token's allowed ids (see :meth:`GrammarMasks.allowed`),
        or ``None`` when nothing is enforced (see the class)."""
        if self.state is None or self.done:
            return None
        if self.masks.masks(self.state).empty:
            self.state, self.gave_up = None, "no token of the vocabulary continues the object"
            return None
        return self.masks.allowed(self.state, tokens_left)

    def advance(self, token_id: int) -> None:
        """Feed the generated ``token_id``."""
        if self.state is None:
            return
        data = self.masks.vocab.bytes[token_id] if 0 <= token_id < self.masks.vocab.size else None
        after = None if data is None else self.masks.grammar.run(self.state, data)
        if after is None:
            self.gave_up = f"token {token_id} is outside the grammar"
        self.state = after


class JsonConstraints:
    """An engine's source of :class:`JsonConstraint`: the vocabulary read once (on first
    use), one :class:`GrammarMasks` per key tuple (the ``max_grammars`` most recent kept,
    so jobs with the same fields share their cached masks).

    Parameters
    ----------
    tokenizer
        The engine's tokenizer (:func:`engine.text.token_bytes.token_bytes` reads it).
    vocab_size
        ``V``, the width of the model's logits.
    """

    def __init__(self, tokenizer, vocab_size: int, max_grammars: int = 16):
        self.tokenizer, self.vocab_size, self.max_grammars = tokenizer, vocab_size, max_grammars
        self._vocab: TokenVocabulary | None = None
        self._grammars: OrderedDict[tuple[str, ...], GrammarMasks] = OrderedDict()

    @property
    def vocab(self) -> TokenVocabulary:
        """The vocabulary as bytes (read on first use).

        Raises
        ------
        ValueError
            The tokenizer's token bytes are unknown (:func:`engine.text.token_bytes.token_bytes`).
        """
        if self._vocab is None:
            from engine.text.token_bytes import token_bytes

            self._vocab = TokenVocabulary(token_bytes(self.tokenizer, self.vocab_size))
        return self._vocab

    def masks(self, keys: Sequence[str]) -> GrammarMasks:
        """The shared masks of the object with ``keys``.

        Raises
        ------
        ValueError
            Bad keys (:class:`JsonObjectGrammar`) or an unreadable vocabulary.
        """
        keys = tuple(keys)
        found = self._grammars.get(keys)
        if found is None:
            found = GrammarMasks(JsonObjectGrammar(keys), self.vocab)
            self._grammars[keys] = found
            if len(self._grammars) > self.max_grammars:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(keys)
        return found

    def new(self, keys: Sequence[str]) -> JsonConstraint:
        """A constraint at the start of the object with ``keys`` (errors as :meth:`masks`)."""
        return JsonConstraint(self.masks(keys))
