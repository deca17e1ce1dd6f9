"""Long-context fidelity tasks generated locally, in the manner of RULER's synthetic tasks.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv:2404.06654; github.com/NVIDIA/RULER) builds prompts of an exact
token length from a haystack and a few inserted facts, and scores an answer by whether the
expected strings appear in it. This module does the same with no download: the haystack is
text the caller gives (documents) or generated noise; keys, values and words come from a
seeded ``random.Random``, so the same seed gives the same prompts.

Tasks (:data:`TASKS`; RULER's names where it has one):

* ``niah_single`` / ``niah_single_word`` / ``niah_single_uuid`` — one needle "The special
  magic number for KEY is: VALUE." at the asked depth; the value a 7-digit number, an
  adjective-noun word or a UUID (RULER ``niah_single_1..3``);
* ``niah_multikey`` — the needle at the asked depth and 3 distractor needles of other keys
  at seeded depths (RULER ``niah_multikey_1``);
* ``niah_multivalue`` — 4 values of one key, the first at the asked depth, the others at
  seeded depths; all 4 are expected (RULER ``niah_multivalue``);
* ``vt`` — variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of 5
  variables (4 hops), the first at the asked depth, the rest spread after it; all 5 names
  are expected (RULER ``vt``, one chain);
* ``cwe`` — common words extraction: a numbered list of coded words where 10 words appear
  many times and the others 3 times each; the 10 are expected (RULER ``cwe``). No
  haystack and no depth.

Lengths. A sample of length ``L`` has a prompt of at most ``L - max_tokens`` tokens (within
a few tokens of it), so prompt and answer fit a context of ``L`` tokens, as RULER counts
``max_seq_length``. Depth is a token fraction of the haystack: a needle at depth ``d`` has
``d`` of the haystack's tokens before it (placed at the nearest sentence boundary;
:attr:`Sample.needle_depths` has the depths reached, measured with the model's tokenizer).

Scoring (:func:`score`): RULER's ``string_match_all`` — the share of expected strings found
(case-insensitive substring) in the answer; a cell's accuracy is the mean over its samples.

Torch-free (the CLI builds and checks the prompts before a model loads).
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

NOISE = (
    "The river runs down to the sea. The hills are quiet in the evening. A bird sings on "
    "the roof, and the wind moves the grass. Then the day goes on as it did before.\n"
)
"""The generated-noise haystack (repeated), when no documents are given."""

ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "mellow", "noisy", "odd", "proud", "quick", "rusty", "silent", "tidy",
    "upbeat", "vivid", "wise", "young", "zesty", "bitter", "cheap", "damp", "early", "fierce",
    "golden", "humble", "lucky", "modern", "narrow", "plain", "rapid", "sharp", "sweet", "wild",
)  # fmt: skip
NOUNS = (
    "anchor", "basket", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island",
    "jacket", "kettle", "ladder", "magnet", "needle", "orchard", "pencil", "quartz", "rocket",
    "saddle", "tunnel", "umbrella", "violin", "wagon", "yacht", "zebra", "bridge", "cactus",
    "desert", "forest", "glacier", "helmet", "lantern", "meadow", "pepper", "river", "silver",
    "teapot", "valley", "window", "button",
)  # fmt: skip

CWE_COMMON = 10  # words expected in a cwe answer (RULER num_cw)
CWE_RARE_FREQ = 3  # times each other word appears (RULER freq_ucw)
MULTI_NEEDLES = 4  # needles of niah_multikey (1 + 3 distractors) and values of niah_multivalue
VT_VARIABLES = 5  # variables in the vt chain (4 hops)


@dataclass(frozen=True)
class TaskSpec:
    """One task: ``max_tokens`` to generate, whether it places facts at a ``depth``."""

    name: str
    max_tokens: int
    uses_depth: bool = True
    about: str = ""


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec("niah_single", 32, about="one needle, a 7-digit number"),
        TaskSpec("niah_single_word", 32, about="one needle, an adjective-noun word"),
        TaskSpec("niah_single_uuid", 64, about="one needle, a UUID"),
        TaskSpec("niah_multikey", 32, about="the needle among 3 distractor keys"),
        TaskSpec("niah_multivalue", 64, about="4 values of one key, all expected"),
        TaskSpec("vt", 40, about="variable tracking, a chain of 5 variables"),
        TaskSpec("cwe", 64, uses_depth=False, about="the 10 most common coded words"),
    )
}


@dataclass(frozen=True)
class Sample:
    """One prompt of the suite.

    Attributes
    ----------
    id : ``task/length/d<depth>/<index>`` (unique in a suite)
    task, length : the task name and the length ``L`` (tokens of prompt + answer)
    depth : the asked depth (token fraction of the haystack), ``None`` for ``cwe``
    index : sample number within (task, length, depth)
    prompt_ids : chat prompt and answer prefix, ``[T]`` token ids, ``T <= L - max_tokens``
    expected : strings the answer must contain (score = share found)
    max_tokens : tokens to generate
    needle_depths : depths reached by each inserted fact (haystack token fractions), in
        haystack order
    question : the question asked (for reports)
    """

    id: str
    task: str
    length: int
    depth: float | None
    index: int
    prompt_ids: tuple[int, ...]
    expected: tuple[str, ...]
    max_tokens: int
    needle_depths: tuple[float, ...] = ()
    question: str = ""


# ----------------------------------------------------------------------------- haystack


@dataclass
class Haystack:
    """Haystack text cut into sentence-sized pieces with their token counts; read
    cyclically from any piece (documents shorter than a prompt repeat)."""

    pieces: list[str]
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer) -> Haystack:
        """Pieces of ``texts`` (in order) at sentence ends and line breaks, long runs cut at
        whitespace near 200 characters; counted with ``tokenizer.encode_text``.

        Raises
        ------
        ValueError
            If the texts hold no visible characters.
        """
        pieces = [p for text in texts for p in _split(text)]
        if not any(p.strip() for p in pieces):
            raise ValueError("the haystack texts are empty")
        return cls(pieces, [len(tokenizer.encode_text(p)) for p in pieces])

    @classmethod
    def noise(cls, tokenizer) -> Haystack:
        """The generated-noise haystack (:data:`NOISE`)."""
        return cls.from_texts([NOISE], tokenizer)

    def take(self, start: int, num_tokens: int) -> tuple[list[str], list[int]]:
        """Pieces from ``start`` on (wrapping) while their token count stays within
        ``num_tokens``; returns the pieces and their token counts."""
        out, counts, total, i = [], [], 0, start % len(self.pieces)
        while total + self.tokens[i] <= num_tokens:
            out.append(self.pieces[i])
            counts.append(self.tokens[i])
            total += self.tokens[i]
            i = (i + 1) % len(self.pieces)
            if len(out) > 10 * len(self.pieces) + num_tokens:  # all pieces 0 tokens
                break
        return out, counts


def _split(text: str, max_chars: int = 200) -> list[str]:
    out = []
    for piece in re.split(r"(?<=[.!?\n])", text):
        while len(piece) > max_chars:
            cut = piece.rfind(" ", max_chars // 2, max_chars)
            cut = cut if cut > 0 else max_chars
            out.append(piece[:cut])
            piece = piece[cut:]
        if piece:
            out.append(piece)
    return out


# ----------------------------------------------------------------------------- building


@dataclass(frozen=True)
class _Parts:
    """A task instance before the haystack: the text around the context, the facts with
    their asked depths (ascending), the expected strings."""

    before: str
    after: str
    answer_prefix: str
    needles: tuple[tuple[float, str], ...]
    expected: tuple[str, ...]
    question: str


class SuiteBuilder:
    """Builds :class:`Sample` prompts for one tokenizer and haystack.

    Parameters
    ----------
    tokenizer : has ``encode_text(str) -> list[int]`` and ``encode_chat(messages) ->
        list[int]`` (:class:`engine.text.tokenizer.TextTokenizer`)
    haystack : the filler (:meth:`Haystack.from_texts` or :meth:`Haystack.noise`)
    seed : every key, value, word and haystack offset is drawn from ``seed`` and the
        sample's place (task, length, depth, index), so a sample does not change when
        other tasks or lengths are added
    """

    def __init__(self, tokenizer, haystack: Haystack, seed: int = 0):
        self.tok = tokenizer
        self.haystack = haystack
        self.seed = seed

    def suite(
        self,
        tasks: Sequence[str],
        lengths: Sequence[int],
        depths: Sequence[float],
        samples: int = 1,
        max_tokens: int | None = None,
        errors: list[str] | None = None,
    ) -> list[Sample]:
        """Every (task, length, depth, index) sample; ``cwe`` has ``len(depths) * samples``
        samples of no depth. ``max_tokens`` overrides each task's own. With an ``errors``
        list, a (task, length) too short for its task is left out and its message appended
        there instead of raised.

        Raises
        ------
        ValueError
            An unknown task, a depth outside [0, 1], or (without ``errors``) a length too
            short for a task.
        """
        check_tasks(tasks)
        for d in depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"depth {d} is outside [0, 1]")
        out = []
        for length in lengths:
            for task in tasks:
                spec = TASKS[task]
                slots = [(d, i) for d in depths for i in range(samples)]
                if not spec.uses_depth:
                    slots = [(None, i) for i in range(len(slots))]
                try:
                    out += [
                        self.sample(task, length, d, i, max_tokens or spec.max_tokens)
                        for d, i in slots
                    ]
                except ValueError as e:
                    if errors is None:
                        raise
                    errors.append(str(e))
        return out

    def sample(
        self, task: str, length: int, depth: float | None, index: int, max_tokens: int
    ) -> Sample:
        """One sample (see :meth:`suite`)."""
        check_tasks([task])
        tag = "-" if depth is None else f"{depth:g}"
        rng = random.Random(f"{self.seed}/{task}/{length}/{tag}/{index}")
        target = length - max_tokens
        if task == "cwe":
            ids, expected, question = self._cwe(rng, target)
            return Sample(
                f"{task}/{length}/d{tag}/{index}", task, length, None, index, tuple(ids),
                expected, max_tokens, (), question,
            )  # fmt: skip
        parts = _PARTS[task](rng, depth if depth is not None else 0.5)
        ids, reached = self._assemble(rng, parts, target, f"{task} at length {length}")
        return Sample(
            f"{task}/{length}/d{tag}/{index}", task, length, depth, index, tuple(ids),
            parts.expected, max_tokens, tuple(reached), parts.question,
        )  # fmt: skip

    # ----- prompt assembly
    def _render(self, parts: _Parts, context: str) -> list[int]:
        msgs = [{"role": "user", "content": parts.before + context + parts.after}]
        return list(self.tok.encode_chat(msgs)) + list(self.tok.encode_text(parts.answer_prefix))

    def _assemble(
        self, rng: random.Random, parts: _Parts, target: int, what: str
    ) -> tuple[list[int], list[float]]:
        """Haystack pieces around the needles so the prompt has at most ``target`` tokens
        (a few fewer at most: the pieces are whole sentences)."""
        start = rng.randrange(len(self.haystack.pieces))
        fixed = len(self._render(parts, "".join(f" {n} " for _, n in parts.needles)))
        budget = target - fixed
        if budget < 8:
            raise ValueError(
                f"{what}: {target} prompt tokens leave no room for a haystack (the task's "
                f"own text takes {fixed}); use a longer length"
            )
        # Piece counts are additive only nearly (merges at the joins): search the budget
        # for the longest prompt within ``target``.
        best, lo, hi = None, 8, 2 * max(budget, 8) + 64
        while lo <= hi:
            mid = (lo + hi) // 2
            pieces, counts = self.haystack.take(start, mid)
            context, spans = _insert(pieces, counts, parts.needles)
            ids = self._render(parts, context)
            if len(ids) <= target:
                best, lo = (ids, context, spans), mid + 1
            else:
                hi = mid - 1
        if best is None:
            raise ValueError(f"{what}: could not fit the prompt in {target} tokens")
        ids, context, spans = best
        return ids, self._depths(context, spans)

    def _depths(self, context: str, spans: list[tuple[int, int]]) -> list[float]:
        """Each needle's depth: haystack tokens before it / all haystack tokens."""
        enc = self.tok.encode_text
        needle_tokens = [len(enc(context[a:b])) for a, b in spans]
        hay = len(enc(context)) - sum(needle_tokens)
        out = []
        for j, (a, _) in enumerate(spans):
            before = len(enc(context[:a])) - sum(needle_tokens[:j])
            out.append(round(max(before, 0) / max(hay, 1), 4))
        return out

    def _cwe(self, rng: random.Random, target: int) -> tuple[list[int], tuple[str, ...], str]:
        """A numbered list of coded words: :data:`CWE_COMMON` words many times, the others
        :data:`CWE_RARE_FREQ` times; as many rare words as fit ``target`` tokens."""
        words = _coded_words(rng, 4000)
        common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
        question = f"What are the {CWE_COMMON} most common words in the list above? Do not explain."
        parts = _Parts(
            "Below is a numbered list of coded words. Keep track of how often each word "
            "appears.\n\n",
            f"\n\nQuestion: {question}",
            f"Answer: The {CWE_COMMON} most common words in the list are:",
            (),
            tuple(common),
            question,
        )
        per_entry = max(len(self.tok.encode_text(" 123. " + w)) for w in words[:50])
        room = max(target - len(self._render(parts, "")), 0) // per_entry
        freq = max(CWE_RARE_FREQ + 1, min(30, room // (2 * CWE_COMMON)))
        if room < CWE_COMMON * freq:
            raise ValueError(
                f"cwe: {target} prompt tokens are too few for the word list; use a longer length"
            )
        shuffle_seed = rng.random()

        def render(num_rare: int) -> list[int]:
            entries = common * freq + rare[:num_rare] * CWE_RARE_FREQ
            random.Random(shuffle_seed).shuffle(entries)
            return self._render(parts, " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)))

        estimate = (room - CWE_COMMON * freq) // CWE_RARE_FREQ
        best, lo, hi = None, 0, min(len(rare), 2 * estimate + 16)
        while lo <= hi:  # the most rare words that fit
            mid = (lo + hi) // 2
            ids = render(mid)
            if len(ids) <= target:
                best, lo = ids, mid + 1
            else:
                hi = mid - 1
        if best is None:
            raise ValueError(f"cwe: could not fit the word list in {target} tokens")
        ids = best
        return ids, tuple(common), question


def _insert(
    pieces: list[str], counts: list[int], needles: Sequence[tuple[float, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """Join ``pieces`` with each needle at the piece boundary nearest its depth (a token
    fraction); returns the text and each needle's character span."""
    total = sum(counts)
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + c)
    at = {}
    for j, (d, _) in enumerate(needles):
        b = min(range(len(cum)), key=lambda i: (abs(cum[i] - d * total), i))
        at.setdefault(b, []).append(j)
    text, spans = "", [(0, 0)] * len(needles)
    for b in range(len(pieces) + 1):
        for j in at.get(b, ()):
            sep = "" if not text or text[-1].isspace() else " "
            text += sep
            spans[j] = (len(text), len(text) + len(needles[j][1]))
            nxt = pieces[b] if b < len(pieces) else "\n"
            text += needles[j][1] + ("" if nxt[:1].isspace() else " ")
        if b < len(pieces):
            text += pieces[b]
    return text, spans


# ----------------------------------------------------------------------------- tasks


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah_text(kind: str, key: str, many: bool) -> tuple[str, str, str, str]:
    """(before, after, answer prefix, question) of a needle task."""
    plural = f"{kind}s" if many else kind
    question = (
        f"What are all the special magic {plural} for {key} mentioned in the text?"
        if many
        else f"What is the special magic {kind} for {key} mentioned in the text?"
    )
    before = (
        f"Some special magic {kind}s are hidden in the following text. Remember them; you "
        f"will be asked about them afterwards.\n\n"
    )
    verb = "are" if many else "is"
    prefix = f"The special magic {plural} for {key} mentioned in the text {verb}:"
    return before, f"\n\n{question}", prefix, question


def _needle(kind: str, key: str, value: str) -> str:
    return f"The special magic {kind} for {key} is: {value}."


def _single(make_value: Callable[[random.Random], str], kind: str):
    def parts(rng: random.Random, depth: float) -> _Parts:
        key, value = _key(rng), make_value(rng)
        before, after, prefix, q = _niah_text(kind, key, many=False)
        return _Parts(before, after, prefix, ((depth, _needle(kind, key, value)),), (value,), q)

    return parts


def _multikey(rng: random.Random, depth: float) -> _Parts:
    keys: list[str] = []
    while len(keys) < MULTI_NEEDLES:
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    values = [_number(rng) for _ in keys]
    depths = [depth] + [rng.random() for _ in keys[1:]]
    needles = sorted(
        (d, _needle("number", k, v)) for d, k, v in zip(depths, keys, values, strict=True)
    )
    before, after, prefix, q = _niah_text("number", keys[0], many=False)
    return _Parts(before, after, prefix, tuple(needles), (values[0],), q)


def _multivalue(rng: random.Random, depth: float) -> _Parts:
    key = _key(rng)
    values: list[str] = []
    while len(values) < MULTI_NEEDLES:
        v = _number(rng)
        if v not in values:
            values.append(v)
    depths = [depth] + [rng.random() for _ in values[1:]]
    needles = sorted((d, _needle("number", key, v)) for d, v in zip(depths, values, strict=True))
    before, after, prefix, q = _niah_text("number", key, many=True)
    return _Parts(before, after, prefix, tuple(needles), tuple(values), q)


def _vt(rng: random.Random, depth: float) -> _Parts:
    names: list[str] = []
    while len(names) < VT_VARIABLES:
        n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if n not in names:
            names.append(n)
    value = str(rng.randint(10_000, 99_999))
    lines = [f"VAR {names[0]} = {value}."]
    lines += [f"VAR {b} = VAR {a}." for a, b in zip(names[:-1], names[1:], strict=True)]
    step = (1.0 - depth) / VT_VARIABLES
    needles = tuple((depth + j * step, line) for j, line in enumerate(lines))
    question = f"Find all variables that are assigned the value {value} in the text above."
    before = (
        "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
    )
    prefix = (
        f"Answer: According to the chain of variable assignments in the text above, "
        f"{VT_VARIABLES} variables are assigned the value {value}, they are:"
    )
    return _Parts(before, f"\n\nQuestion: {question}", prefix, needles, tuple(names), question)


_PARTS: dict[str, Callable[[random.Random, float], _Parts]] = {
    "niah_single": _single(_number, "number"),
    "niah_single_word": _single(lambda r: f"{r.choice(ADJECTIVES)}-{r.choice(NOUNS)}", "word"),
    "niah_single_uuid": _single(_uuid, "uuid"),
    "niah_multikey": _multikey,
    "niah_multivalue": _multivalue,
    "vt": _vt,
}


def _coded_words(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct pronounceable coded words (2-3 consonant-vowel syllables + a
    consonant), in a seeded order."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        syl = rng.randint(2, 3)
        w = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syl))
        w += rng.choice(consonants)
        if w not in words:
            words.add(w)
            out.append(w)
    return out


# ----------------------------------------------------------------------------- scoring


def score(expected: Sequence[str], answer: str) -> float:
    """RULER's ``string_match_all`` for one sample: the share of ``expected`` strings that
    occur in ``answer`` (case-insensitive substring), in [0, 1]."""
    if not expected:
        raise ValueError("nothing expected")
    low = answer.lower()
    return sum(e.lower() in low for e in expected) / len(expected)


def check_tasks(tasks: Sequence[str]) -> None:
    """Raises ``ValueError`` naming any unknown task and the known ones."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task(s) {', '.join(bad)}; known: {', '.join(TASKS)}")
