"""Constrained decoding to a JSON object with given keys (:mod:`engine.decode.json_constraint`).

The automaton on its own (awkward keys, escapes, numbers, UTF-8, whitespace, the fewest
closing bytes against a breadth-first search), its masks against a brute-force run of every
token, the real SmolLM2 vocabulary (vocabulary only: token bytes equal the tokenizer's
decoding, special tokens never pass, random walks through the masks always end in an object
``json.loads`` parses), and the engine: constrained replies parse within ``max_tokens``,
greedy and sampled, and unconstrained jobs of the same batch get the same tokens as without
their constrained neighbour (synchronous and asynchronous schedules; on CUDA with graphs).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import deque

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.decode.json_constraint import (
    MAX_WS,
    GrammarMasks,
    JsonConstraint,
    JsonObjectGrammar,
    TokenVocabulary,
)
from engine.events import Job, JobFailed, JobFinished

KEYS = ("title", "summary")
VALID = [
    '{"title": "Sorting", "summary": "Quick sort."}',
    '{"title":"","summary":""}',
    '{\n  "title": "a \\"quoted\\" \\\\ word\\n\\t\\/\\b\\f\\r",\n  "summary": "\\u00e9\\uD83D\\ude00"\n}',
    '{"title": -0, "summary": 1.5e-3}',
    '{"title": 0.25, "summary": 12E+7}',
    '{"title": true, "summary": null}',
    '{"title": [], "summary": [ "a" , 1, false, null, -2.0e1 ]}',
    '{"title": "été — 日本語 😀", "summary": "x"}',
    '{\t"title"\t:\t"x"\t,\t"summary"\t:\t"y"\t}',
]
INVALID = [
    '{"summary": "x", "title": "y"}',  # wrong order
    '{"title": "x"}',  # a key missing
    '{"title": "x", "summary": "y", "z": 1}',  # an extra key
    '{"title": 01, "summary": 1}',  # leading zero
    '{"title": 1., "summary": 1}',  # no fraction digit
    '{"title": -, "summary": 1}',
    '{"title": 1e, "summary": 1}',
    '{"title": "a\nb", "summary": 1}',  # raw control character in a string
    '{"title": "\\x", "summary": 1}',  # bad escape
    '{"title": "\\u12G4", "summary": 1}',
    '{"title": {"a": 1}, "summary": 1}',  # nested object
    '{"title": [[1]], "summary": 1}',  # nested array
    '{"title": [1,], "summary": 1}',  # trailing comma
    '{"title": tru, "summary": 1}',
    '{"title": "x", "summary": 1}}',  # anything after the object
    ' {"title": "x", "summary": 1}',  # anything before it
    '{' + ' ' * (MAX_WS + 1) + '"title": 1, "summary": 1}',  # endless whitespace
]
BAD_UTF8 = [b"\xc0\x80", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xc3("]


def _parses_as_object(text: str, keys=KEYS) -> bool:
    value = json.loads(text)
    return isinstance(value, dict) and tuple(value) == keys


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_are_accepted_and_parse(text):
    g = JsonObjectGrammar(KEYS)
    assert g.run(g.start, text.encode()) == g.accept
    assert _parses_as_object(text)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_objects_are_refused(text):
    g = JsonObjectGrammar(KEYS)
    assert g.run(g.start, text.encode()) != g.accept


@pytest.mark.parametrize("raw", BAD_UTF8)
def test_malformed_utf8_in_a_string_is_refused(raw):
    g = JsonObjectGrammar(KEYS)
    data = b'{"title": "a' + raw + b'", "summary": 1}'
    assert g.run(g.start, data) != g.accept


@pytest.mark.parametrize("keys", [('say "hi"',), ("back\\slash", "é—日本"), ("tab\there", "\u0001")])
def test_awkward_keys_are_written_as_json_strings(keys):
    g = JsonObjectGrammar(keys)
    text = json.dumps(dict.fromkeys(keys, "v"), ensure_ascii=False)
    assert g.run(g.start, text.encode()) == g.accept
    assert _parses_as_object(text, keys)
    # the \\u escape of the same key is not the key's literal spelling: refused
    escaped = json.dumps(dict.fromkeys(keys, "v"), ensure_ascii=True)
    if escaped != text:
        assert g.run(g.start, escaped.encode()) != g.accept


def test_bad_key_lists_are_refused():
    for keys in [(), ("",), ("a", "a")]:
        with pytest.raises(ValueError):
            JsonObjectGrammar(keys)


def test_random_objects_from_json_dumps_are_accepted():
    rng = random.Random(5)
    alphabet = 'ab "\\/\n\t\x01é日😀\u2028{}[],:'

    def scalar():
        kind = rng.randrange(5)
        if kind == 0:
            return "".join(rng.choice(alphabet) for _ in range(rng.randrange(8)))
        if kind == 1:
            return rng.randint(-(10**6), 10**6)
        if kind == 2:
            return rng.uniform(-1e9, 1e9) * 10 ** rng.randint(-30, 30)
        return [True, False, None][rng.randrange(3)]

    for n in range(200):
        keys = tuple(f"k{i}{rng.choice(alphabet)}" for i in range(1 + n % 3))
        g = JsonObjectGrammar(keys)
        value = {k: ([scalar() for _ in range(rng.randrange(4))] if rng.random() < 0.3 else scalar())
                 for k in keys}  # fmt: skip
        for ascii_only in (True, False):
            key_text = json.dumps(value, ensure_ascii=ascii_only)
            if not ascii_only or key_text == json.dumps(value, ensure_ascii=False):
                assert g.run(g.start, key_text.encode()) == g.accept, key_text


ALPHABET = sorted(set(b'{}[]":,0123456789-+.eE \\u"tfnrlsaiumy\xc3\xa9'))  # keys' letters too


def _shortest_completion(g: JsonObjectGrammar, state) -> int:
    """Breadth-first search over a small alphabet: bytes from ``state`` to acceptance."""
    seen, queue = {state}, deque([(state, 0)])
    while queue:
        s, d = queue.popleft()
        if s == g.accept:
            return d
        for b in ALPHABET:
            t = g.step(s, b)
            if t is not None and t not in seen:
                seen.add(t)
                queue.append((t, d + 1))
    raise AssertionError("no completion")


@pytest.mark.parametrize("text", VALID[:7])
def test_closing_bytes_are_the_shortest_completion(text):
    g = JsonObjectGrammar(KEYS)
    state = g.start
    assert g.closing_bytes(state) == len('{"title":0,"summary":0}')
    data = text.encode()
    for i in range(0, len(data), 3):  # every third prefix keeps the search short
        state = g.run(g.start, data[:i])
        assert g.closing_bytes(state) == _shortest_completion(g, state), data[:i]


# ----- masks against the vocabulary ------------------------------------------------------

EXTRA_TOKENS = [  # multi-byte tokens beside the 256 single bytes (partial UTF-8 among them)
    b'{"', b'":', b'": "', b'", "', b'"}', b'"]', b' "', b"true", b"null", b"12", b"-0",
    b".5", b"e+", b"\\u00", b"\\n", b"\xc3\xa9t\xc3\xa9", b"\xe2\x82", b"\n  ", b'""', b"[]",
    b"title", b"summary", b"},", b" " * (MAX_WS + 2), b'a"b', b'0, "summary": ', b'"title',
    b"\xf0\x9f\x98", b"\x01\x02",
]  # fmt: skip


def _vocabulary(extra=EXTRA_TOKENS, holes=4) -> list[bytes | None]:
    """The 256 single bytes, ``extra`` tokens, and ``holes`` ids without bytes (special)."""
    return [bytes([b]) for b in range(256)] + list(extra) + [None] * holes


def _brute_force(g, vocab, state, tokens_left):
    ok, budget = [], []
    for i, t in enumerate(vocab.bytes):
        after = None if t is None else g.run(state, t)
        if after is not None:
            ok.append(i)
            if g.closing_bytes(after) <= tokens_left - 1:
                budget.append(i)
    return set(budget or ok)


def test_masks_equal_running_every_token():
    g = JsonObjectGrammar(KEYS)
    vocab = TokenVocabulary(_vocabulary())
    masks = GrammarMasks(g, vocab)
    prefixes = ["", "{", '{"ti', '{"title": ', '{"title": "ab', '{"title": "a\\', '{"title": "a\\u0',
                '{"title": "\xc3', '{"title": 1', '{"title": -', '{"title": [', '{"title": ["x", ',
                '{"title": tr', '{"title": 1.5e', '{"title": "x", "summary": "y"']  # fmt: skip
    states = set()
    for p in prefixes:
        data = p.encode("latin-1") if "\xc3" in p else p.encode()
        state = g.run(g.start, data)
        assert state is not None, p
        states.add(state)
        for left in (1, 2, 3, 5, 8, 13, 40, 1000):
            got = set(masks.allowed(state, left).nonzero().flatten().tolist())
            assert got == _brute_force(g, vocab, state, left), (p, left)
    assert masks.computed == len(states)  # one build per state, then the cache


def _walk(constraint: JsonConstraint, vocab_bytes, budget: int, rng: random.Random) -> bytes:
    """A reply drawn uniformly from the allowed tokens at every step, ``budget`` tokens."""
    out = b""
    for used in range(budget):
        allowed = constraint.allowed(budget - used)
        assert allowed is not None
        ids = allowed.nonzero().flatten().tolist()
        token = rng.choice(ids)
        out += vocab_bytes[token]
        constraint.advance(token)
        if constraint.done:
            break
    return out


def test_random_walks_close_the_object_within_the_budget():
    g = JsonObjectGrammar(KEYS)
    vocab = TokenVocabulary(_vocabulary())
    masks = GrammarMasks(g, vocab)
    rng = random.Random(0)
    least = g.closing_bytes(g.start)
    for budget in [least, least + 1, least + 7, 60, 200]:
        for _ in range(5):
            c = JsonConstraint(masks)
            text = _walk(c, vocab.bytes, budget, rng)
            assert c.done, (budget, text)
            assert _parses_as_object(text.decode("utf-8"))


def test_a_budget_below_the_punctuation_is_ignored_and_the_object_cut():
    g = JsonObjectGrammar(KEYS)
    vocab = TokenVocabulary(_vocabulary())
    c = JsonConstraint(GrammarMasks(g, vocab))
    text = _walk(c, vocab.bytes, 5, random.Random(1))
    assert not c.done and g.run(g.start, text) is not None  # a prefix, never finished


def test_tokens_off_the_grammar_or_unspellable_keys_give_up():
    vocab = TokenVocabulary(_vocabulary())
    c = JsonConstraint(GrammarMasks(JsonObjectGrammar(KEYS), vocab))
    c.advance(ord("x"))
    assert c.state is None and "outside the grammar" in c.gave_up and c.allowed(10) is None
    # a vocabulary without the byte 'q' cannot spell the key "q"
    no_q = TokenVocabulary([None if b == ord("q") else bytes([b]) for b in range(256)])
    c = JsonConstraint(GrammarMasks(JsonObjectGrammar(("q",)), no_q))
    c.advance(ord("{"))
    c.advance(ord('"'))
    assert c.allowed(10) is None and "no token" in c.gave_up


# ----- the real vocabulary (the embedded SmolLM2's, vocabulary only) ---------------------


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_tokenizer):
    from engine.text.token_bytes import token_bytes

    return token_bytes(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


def test_token_bytes_equal_the_tokenizers_decoding(smollm2_tokenizer, smollm2_vocab):
    tok = smollm2_tokenizer
    assert len(smollm2_vocab) == 49152
    text = 'Résumé: {"a": [1, 2.5e-3]} — 日本語 😀\n\tend "quoted" \\ back'
    ids = tok.encode(text, special=False)
    assert b"".join(smollm2_vocab[i] for i in ids).decode("utf-8") == tok.decode(ids) == text
    for i in range(0, 49152, 7):
        data = smollm2_vocab[i]
        if data is not None:
            assert data.decode("utf-8", "replace") == tok.decode([i]), i
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert smollm2_vocab[tok.token_to_id(special)] is None


def test_real_vocabulary_walks_parse_and_never_emit_special_tokens(smollm2_tokenizer, smollm2_vocab):
    from engine.decode.json_constraint import JsonConstraints

    tok = smollm2_tokenizer
    constraints = JsonConstraints(tok, tok.vocab_size)
    specials = [i for i, t in enumerate(smollm2_vocab) if t is None]
    assert len(specials) >= 3
    start = constraints.new(KEYS).allowed(1000)
    assert not start[specials].any()
    assert {tok.decode([i])[0] for i in start.nonzero().flatten().tolist()} == {"{"}
    rng = random.Random(3)
    for budget in (23, 30, 48):
        c = constraints.new(("title", 'say "é"'))
        text = _walk(c, smollm2_vocab, budget, rng)
        assert c.done
        assert _parses_as_object(text.decode("utf-8"), ("title", 'say "é"'))


# ----- the engine --------------------------------------------------------------------------

V = 300  # the model's vocabulary: 256 bytes + EXTRA_TOKENS + undefined ids


def _byte_tokenizer():
    """A byte-level :class:`TextTokenizer` over ``_vocabulary()``'s tokens, with
    ``<|im_end|>`` as a special (end) token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from engine.text.tokenizer import TextTokenizer, bytes_to_unicode

    table = bytes_to_unicode()
    spelled = ["".join(table[b] for b in t) for t in _vocabulary(holes=0)]
    vocab = {s: i for i, s in enumerate(spelled)}
    assert len(vocab) == len(spelled)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    end = backend.token_to_id("<|im_end|>")
    return TextTokenizer(backend, bos_id=None, eos_ids=[end], add_bos=False, chat_template=None,
                         vocab_size=V)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model():
    from engine.model.llama import LlamaModel
    from engine.model.rope import Rope
    from engine.weights.synthetic import TINY, synthetic_weights

    cfg = dataclasses.replace(TINY, vocab_size=V)
    weights = synthetic_weights(cfg, device="cpu")
    return LlamaModel(weights, torch.device("cpu"), torch.float32, "int4", Rope(cfg.head_dim, cfg.rope_theta))  # noqa: E501


def _engine(model, async_decode: bool, device="cpu", **kw):
    from engine.serve.engine import Engine
    from kernels.dispatch import get_ops

    dtype = "float32" if device == "cpu" else "bfloat16"
    cfg = EngineConfig(device=device, dtype=dtype, kv_dtype=dtype, host_pool_gb=0.05,
                       max_batch=4, page_size=16, async_decode=async_decode, **kw)  # fmt: skip
    return Engine(model, _byte_tokenizer(), cfg, get_ops(device), 2048)


def _jobs(constrained: bool):
    gen = torch.Generator().manual_seed(2)
    free = [
        Job(f"free{i}", tuple(torch.randint(0, 256, (n,), generator=gen).tolist()),
            SamplingParams(max_tokens=m, temperature=t, seed=4))
        for i, (n, m, t) in enumerate([(40, 12, 0.0), (70, 20, 0.0), (33, 9, 0.9)])
    ]  # fmt: skip
    if not constrained:
        return free
    prompt = tuple(torch.randint(0, 256, (50,), generator=gen).tolist())
    json_jobs = [
        Job("json-greedy", prompt, SamplingParams(max_tokens=40), json_keys=KEYS),
        Job("json-sampled", prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=1),
            json_keys=("a\"b", "é")),
        Job("json-tight", prompt, SamplingParams(max_tokens=23), json_keys=KEYS),  # the least
        Job("json-short", prompt, SamplingParams(max_tokens=6), json_keys=KEYS),  # below it
    ]  # fmt: skip
    return [json_jobs[0], free[0], json_jobs[1], free[1], json_jobs[2], free[2], json_jobs[3]]


def _run(engine, jobs):
    out = {}
    for e in engine.run(jobs):
        if isinstance(e, JobFinished):
            out[e.result.job_id] = e.result
        elif isinstance(e, JobFailed):
            raise AssertionError(e)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model):
    """``runs(async_decode, constrained)``: the engine's results for :func:`_jobs`, each
    configuration run once per module."""
    done = {}

    def get(async_decode: bool, constrained: bool):
        key = (async_decode, constrained)
        if key not in done:
            done[key] = _run(_engine(tiny_model, async_decode), _jobs(constrained))
        return done[key]

    return get


@pytest.mark.parametrize("async_decode", [False, True], ids=["sync", "async"])
def test_engine_replies_parse_and_neighbours_are_unaffected(runs, async_decode):
    alone, mixed = runs(async_decode, False), runs(async_decode, True)
    for job_id, r in alone.items():
        assert mixed[job_id].token_ids == r.token_ids, job_id
    keys = {"json-greedy": KEYS, "json-sampled": ("a\"b", "é"), "json-tight": KEYS}
    for job_id, k in keys.items():
        r = mixed[job_id]
        assert r.finish_reason == "stop" and len(r.token_ids) <= 40, (job_id, r.text)
        assert _parses_as_object(r.text, k), r.text
    short = mixed["json-short"]
    assert short.finish_reason == "length" and len(short.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.text)
    # the same constrained jobs in both schedules give the same replies
    other = runs(not async_decode, True)
    assert {k: r.token_ids for k, r in other.items()} == {k: r.token_ids for k, r in mixed.items()}


def test_engine_without_token_bytes_fails_the_job_clearly(tiny_model):
    from engine.serve.engine import Engine
    from engine.weights.synthetic import IdsTokenizer
    from kernels.dispatch import get_ops

    cfg = EngineConfig(device="cpu", dtype="float32", kv_dtype="float32", host_pool_gb=0.05)
    engine = Engine(tiny_model, IdsTokenizer(V), cfg, get_ops("cpu"), 2048)
    jobs = [Job("j", (1, 2, 3), SamplingParams(max_tokens=4), json_keys=KEYS),
            Job("k", (1, 2, 3), SamplingParams(max_tokens=4))]  # fmt: skip
    events = list(engine.run(jobs))
    failed = [e for e in events if isinstance(e, JobFailed)]
    assert [e.job_id for e in failed] == ["j"] and "no vocabulary of text" in failed[0].error
    assert [e.result.job_id for e in events if isinstance(e, JobFinished)] == ["k"]


@pytest.mark.cuda
def test_cuda_graph_steps_mask_constrained_rows_and_chain_the_rest():
    """On CUDA: a step whose batch holds constrained jobs replays its CUDA graph, then takes
    the masked argmax of those rows (one upload of their masks) and is read before the next
    launch; the replies parse. The unconstrained rows get bit for bit the tokens of a run
    whose constrained jobs are replaced by free jobs of the same lengths (the same batches
    step by step). A batch without constrained jobs still chains its steps on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.model.llama import LlamaModel
    from engine.model.rope import Rope
    from engine.weights.synthetic import TINY, synthetic_weights

    shape = dict(num_layers=3, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=64)
    cfg = dataclasses.replace(TINY, intermediate_size=512, vocab_size=V, **shape)
    weights = synthetic_weights(cfg, device="cuda")
    rope = Rope(cfg.head_dim, cfg.rope_theta)
    model = LlamaModel(weights, torch.device("cuda"), torch.bfloat16, "int4", rope)

    def engine(async_decode):
        eng = _engine(model, async_decode, device="cuda")
        assert eng.graphs is not None, eng.graphs_off_reason
        eng.eos_ids = frozenset()  # free twins must not stop early at <|im_end|>
        calls = []
        launch, replay = eng.launch_step, eng.graphs.launch

        def traced_launch(batch, prev=None):
            constrained = any(r.constraint is not None for r in batch)
            calls.append(("chained" if prev is not None else "launch", constrained))
            return launch(batch, prev)

        def traced_replay(*args, **kwargs):
            out = replay(*args, **kwargs)
            calls.append(("replay", out is not None))
            return out

        eng.launch_step, eng.graphs.launch = traced_launch, traced_replay
        return eng, calls

    free_engine, calls = engine(True)
    _run(free_engine, [j for j in _jobs(False) if j.sampling.temperature == 0])
    assert ("chained", False) in calls

    jobs = _jobs(True)
    keys = {"json-greedy": KEYS, "json-sampled": ("a\"b", "é"), "json-tight": KEYS}
    async_engine, calls = engine(True)  # asked for, but batches with constrained rows not chained
    asynchronous = _run(async_engine, jobs)
    assert ("replay", True) in calls and ("launch", True) in calls
    assert ("chained", True) not in calls
    mixed_engine, calls = engine(False)
    mixed = _run(mixed_engine, jobs)
    for job_id, k in keys.items():
        for run in (mixed, asynchronous):
            assert run[job_id].finish_reason == "stop", run[job_id].text
            assert _parses_as_object(run[job_id].text, k), run[job_id].text

    def twin(job):
        n = len(mixed[job.id].token_ids)
        return dataclasses.replace(job, json_keys=None, sampling=dataclasses.replace(job.sampling, max_tokens=n))

    twins = _run(engine(False)[0], [twin(j) if j.json_keys else j for j in jobs])
    for job_id in ("free0", "free1", "free2"):
        assert mixed[job_id].token_ids == twins[job_id].token_ids, job_id
    assert twins["json-greedy"].token_ids != mixed["json-greedy"].token_ids  # the mask acted


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_masked_greedy_is_the_argmax_over_the_allowed_tokens(device):
    from engine.decode.sampling import masked_greedy

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (5, 50), generator=gen).float().to(device)  # many ties
    greedy = logits.argmax(dim=-1)
    allowed = {}
    for i in (0, 2, 3):
        allowed[i] = torch.rand(50, generator=gen) < 0.3
    allowed[3][int(greedy[3])] = True  # an argmax the mask keeps
    allowed[0][int(greedy[0])] = False  # one it overrules
    out = masked_greedy(logits, greedy, allowed).cpu()
    for i in range(5):
        if i in allowed:
            ids = allowed[i].nonzero().flatten()
            best = logits[i].cpu()[ids]
            assert int(out[i]) == int(ids[(best == best.max()).nonzero()[0, 0]])  # lowest id
        else:
            assert int(out[i]) == int(greedy[i])
