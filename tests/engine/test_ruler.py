"""The RULER-style task generator and scoring (:mod:`engine.measure.ruler`) and the eval's
configuration specs (:mod:`engine.measure.fidelity`), with a one-character-per-token
tokenizer: depths and lengths are then exact character counts."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from engine.config import ConfigError, EngineConfig
from engine.measure import fidelity, ruler


class CharTokenizer:
    """One token per character; a chat turn is ``<u>CONTENT<a>``."""

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode_text("<u>" + messages[0]["content"] + "<a>")

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))


TOK = CharTokenizer()
HAY_TEXT = "".join(f"Filler sentence number {i} goes here. " for i in range(300))


def builder(seed: int = 0, text: str = HAY_TEXT) -> ruler.SuiteBuilder:
    return ruler.SuiteBuilder(TOK, ruler.Haystack.from_texts([text], TOK), seed)


def context_of(sample: ruler.Sample) -> str:
    return TOK.decode(sample.prompt_ids)


def test_same_seed_same_prompts_other_seed_other_values():
    tasks = list(ruler.TASKS)
    a = builder(0).suite(tasks, [3000], [0.25, 0.75])
    b = builder(0).suite(tasks, [3000], [0.25, 0.75])
    c = builder(1).suite(tasks, [3000], [0.25, 0.75])
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.expected for s in a] == [s.expected for s in b]
    assert all(x.expected != y.expected for x, y in zip(a, c, strict=True))
    # a sample does not depend on which other tasks or lengths are asked for
    alone = builder(0).suite(["vt"], [3000], [0.75])
    assert alone[0] == next(s for s in a if s.task == "vt" and s.depth == 0.75)


@pytest.mark.parametrize("task", [t for t, spec in ruler.TASKS.items() if spec.uses_depth])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_the_asked_depth_by_token_count(task, depth):
    s = builder(3).sample(task, 4000, depth, 0, ruler.TASKS[task].max_tokens)
    text = context_of(s)
    body = text[text.index("\n\n") + 2 : text.rindex("\n\n")]  # the haystack with its needles
    needles = [
        m.span()
        for m in re.finditer(r"(The special magic \w+ for \S+ is: \S+?\.|VAR \w+ = [^.]+\.)", body)
    ]  # noqa: E501
    assert len(needles) == len(s.needle_depths)
    needle_chars = sum(b - a for a, b in needles)
    hay = len(body) - needle_chars
    reached = []
    for j, (a, _) in enumerate(needles):
        before = a - sum(b - a for a, b in needles[:j])
        reached.append(before / hay)
    assert reached == pytest.approx(list(s.needle_depths), abs=2e-3)  # the report is right
    piece = 40 / hay  # the filler's sentences are ~40 tokens: the nearest boundary
    first = reached[0] if task != "niah_multikey" else None
    if task == "niah_multikey":  # the target needle (queried key) is at the asked depth
        key = re.search(r"for (\S+) mentioned", text).group(1)
        at = next(i for i, (a, b) in enumerate(needles) if f"for {key} is" in body[a:b])
        first = reached[at]
    elif task == "niah_multivalue":
        first = min(reached, key=lambda r: abs(r - depth))
    assert abs(first - depth) <= piece


@pytest.mark.parametrize("task", list(ruler.TASKS))
@pytest.mark.parametrize("length", [2048, 5000])
def test_prompt_fits_its_length_and_the_answer_is_recoverable(task, length):
    s = builder(5).sample(task, length, 0.5, 0, ruler.TASKS[task].max_tokens)
    assert length - s.max_tokens - 64 <= len(s.prompt_ids) <= length - s.max_tokens
    text = context_of(s)
    question = text[text.rindex("\n\n") :]
    if task.startswith("niah"):
        key = re.search(r"for (\S+) mentioned", question).group(1)
        found = re.findall(
            rf"The special magic \w+ for {re.escape(key)} is: (\S+?)\.(?:\s|$)", text
        )
        assert sorted(found) == sorted(s.expected)
        n_needles = len(re.findall(r"The special magic \w+ for \S+ is:", text))
        assert n_needles == {"niah_multikey": 4, "niah_multivalue": 4}.get(task, 1)
    elif task == "vt":
        value = re.search(r"assigned the value (\d+) in", question).group(1)
        assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", text))
        chain = {v for v, rhs in assign.items() if rhs == value}
        while True:
            more = {v for v, rhs in assign.items() if rhs.removeprefix("VAR ") in chain} - chain
            if not more:
                break
            chain |= more
        assert chain == set(s.expected) and len(chain) == ruler.VT_VARIABLES
    elif task == "cwe":
        words = Counter(re.findall(r"\d+\. (\w+)", text))
        top = [w for w, _ in words.most_common(ruler.CWE_COMMON)]
        assert set(top) == set(s.expected)
        rest = [n for w, n in words.items() if w not in s.expected]
        assert min(words[w] for w in s.expected) > max(rest)


def test_noise_haystack_and_a_length_too_short():
    s = ruler.SuiteBuilder(TOK, ruler.Haystack.noise(TOK), 0).sample(
        "niah_single", 1500, 0.5, 0, 16
    )
    assert ruler.NOISE.split(".")[0] in context_of(s)
    with pytest.raises(ValueError, match="no room for a haystack"):
        builder().sample("niah_multivalue", 300, 0.5, 0, 16)
    errors: list[str] = []
    out = builder().suite(["cwe", "niah_single"], [400], [0.5], errors=errors)
    assert [s.task for s in out] == ["niah_single"] and "cwe" in errors[0]
    with pytest.raises(ValueError, match="unknown task"):
        builder().suite(["niah_triple"], [2048], [0.5])
    with pytest.raises(ValueError, match="outside"):
        builder().suite(["niah_single"], [2048], [1.5])


def test_score_is_recall_of_the_expected_strings():
    assert ruler.score(["1234567"], "The number is 1234567.") == 1.0
    assert ruler.score(["1234567"], "The number is 1234568.") == 0.0
    assert ruler.score(["ABCDE", "fghij", "KLMNO", "PQRST"], "abcde, FGHIJ and klmno") == 0.75
    with pytest.raises(ValueError):
        ruler.score([], "x")


def test_config_specs():
    base = EngineConfig(top_k=2048, device_buffer=4096)
    dense, sparse, small, oracle = fidelity.parse_configs(
        "dense, sparse,top_k=512:page=32:combine=sum,indexer=oracle"
    )
    assert dense.dense and dense.engine_config(base).attention == "dense"
    assert not dense.engine_config(base).hierarchical
    assert sparse.engine_config(base) == base.replace(attention="sparse")
    cfg = small.engine_config(base)
    assert (cfg.top_k, cfg.page_size, cfg.group_combine, cfg.device_buffer_tokens) == (
        512, 32, "sum", 1024,
    )  # fmt: skip
    assert oracle.engine_config(base).indexer == "oracle"
    [fp8] = fidelity.parse_configs("host=fp8")
    assert fp8.engine_config(base).kv_host_dtype == "fp8"
    with pytest.raises(ConfigError, match="config 'host=fp16'"):
        fidelity.parse_configs("host=fp16")[0].engine_config(base)
    for bad, match in [
        ("top_k=abc", "not an integer"),
        ("oversample=2", "oversample works only with meta=superpage"),
        ("pages=16", "not key=value"),
        ("dense,dense", "twice"),
        ("", "no configurations"),
    ]:
        with pytest.raises(ValueError, match=match):
            fidelity.parse_configs(bad)
    with pytest.raises(ConfigError, match="config 'page=17'"):
        fidelity.parse_configs("page=17")[0].engine_config(base)


def test_accuracy_table_means_scores_per_cell():
    rows = [
        {"task": "t", "length": 8, "answers": {"dense": {"score": 1.0}, "s": {"score": 0.0}}},
        {"task": "t", "length": 8, "answers": {"dense": {"score": 1.0}, "s": {"score": 0.5}}},
        {"task": "u", "length": 8, "answers": {"dense": {"score": 0.0}, "s": {"score": 1.0}}},
    ]
    table = fidelity.accuracy_table(rows, ["dense", "s"])
    got = {(c["task"], c["config"]): (c["accuracy"], c["dense"], c["samples"]) for c in table}
    assert got == {
        ("t", "dense"): (100.0, 100.0, 2),
        ("t", "s"): (25.0, 100.0, 2),
        ("u", "dense"): (0.0, 0.0, 1),
        ("u", "s"): (100.0, 0.0, 1),
    }
