"""Selection traces and policy replay: policy semantics on hand-built streams, LRU replay
== the resolve reference, trace round trip, the ``replay`` command, and LRU replay of a
real-model trace == the engine's own hit / miss counts."""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest
import torch
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from engine.measure.replay import POLICIES, load_streams, replay, replay_stream, replay_trace
from engine.measure.trace import TraceHeader, TraceWriter, pages_from_words, read_header, read_trace
from kernels.bitmask import pack_bits, unpack_bits
from kernels.resolve import resolve_ref

# Silberschatz's reference string with 3 frames: OPT 9 faults, LRU 12, FIFO 15.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def misses(steps, capacity, policy):
    return replay_stream(steps, capacity, policy)[1]


def test_textbook_reference_string():
    steps = [[p] for p in TEXTBOOK]
    assert misses(steps, 3, "belady") == 9
    assert misses(steps, 3, "lru") == 12
    assert misses(steps, 3, "fifo") == 15


def test_lru_refreshes_hits_fifo_does_not():
    steps = [[0], [1], [0], [2], [0]]
    assert misses(steps, 2, "lru") == 3  # 2 evicts 1 (0 was refreshed)
    assert misses(steps, 2, "fifo") == 4  # 2 evicts 0 (loaded first)


def test_selected_pages_are_never_evicted():
    # Step 1 selects 0 again: the miss on 2 must evict 1 although 0 is as old.
    for policy in POLICIES:
        assert replay_stream([[0, 1], [0, 2], [0]], 2, policy) == (5, 3, 3), policy


def test_cold_misses_and_capacity_check():
    assert replay_stream([[0, 1], [2, 3], [0, 1]], 4, "lru") == (6, 4, 4)
    with pytest.raises(ValueError, match="capacity"):
        replay_stream([[0, 1, 2]], 2, "lru")


streams_st = st.integers(1, 6).flatmap(
    lambda k: st.tuples(
        st.just(k),
        st.integers(k, 2 * k + 2),
        st.lists(st.sets(st.integers(0, 3 * k + 4), min_size=1, max_size=k), max_size=40),
    )
)


@settings(max_examples=150, deadline=None)
@given(streams_st)
def test_belady_never_worse(case):
    _, capacity, steps = case
    best = misses(steps, capacity, "belady")
    for policy in ("lru", "fifo", "random"):
        assert best <= misses(steps, capacity, policy), policy
    cold = replay_stream(steps, capacity, "belady")[2]
    assert best >= cold


def test_lru_replay_equals_resolve_reference():
    """Per step, the LRU replay misses equal resolve_ref's loads on one slab."""
    rng = random.Random(3)
    capacity, k_max, num_pages = 12, 8, 60
    page_table = torch.full((1, num_pages), -1, dtype=torch.int32)
    slot_page = torch.full((capacity,), -1, dtype=torch.int32)
    last_use = torch.full((capacity,), -1, dtype=torch.int64)
    steps, engine_misses = [], 0
    for t in range(200):
        hot = list(range(max(0, t // 4 - 10), t // 4 + 10))  # drifting working set
        sel = set(rng.sample(hot, rng.randint(1, k_max)))
        steps.append(sorted(sel))
        mask = torch.zeros(1, 1, num_pages, dtype=torch.bool)
        mask[0, 0, sorted(sel)] = True
        _, _, load_slots, _ = resolve_ref(
            pack_bits(mask),
            torch.zeros(1, 1, dtype=torch.int32),
            page_table,
            slot_page,
            last_use,
            t,
            capacity,
            k_max,
        )
        engine_misses += int((load_slots >= 0).sum())
        assert replay_stream(steps, capacity, "lru")[1] == engine_misses, f"step {t}"


def header(**kw):
    base = dict(model="m", page_size=16, top_k=64, top_k_pages=4, num_layers=2, num_kv_heads=2)
    return TraceHeader(**{**base, **kw})


def fake_plan(seq_ids, num_pages, step):
    return SimpleNamespace(
        seq_ids=seq_ids, num_pages=torch.tensor(num_pages, dtype=torch.int32), step=step
    )


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "new/folder/t.jsonl"])
def test_trace_round_trip(tmp_path, name):
    """Records written, closed, appended and read back; a trace's missing folders are made
    when it opens (``--trace out/sel.jsonl`` before the run makes ``out/``)."""
    path = tmp_path / name
    writer = TraceWriter(path, header())
    gen = torch.Generator().manual_seed(0)
    written = []
    for step in (1, 2):
        writer.bind({5: "doc-a", 6: "doc-b"})
        for layer in range(2):
            mask = torch.rand(2, 2, 70, generator=gen) < 0.3
            mask[1, :, 40:] = False  # seq 6 has 40 pages: trimmed to 2 words
            mask[:, :, 31] = True  # bit 31 = sign bit of word 0
            writer(fake_plan([5, 6], [70, 40], step), layer, pack_bits(mask))
            written.append(mask)
        if step == 1:
            writer.close()  # records after close are appended
    writer.close()
    assert read_header(path) == header()
    records = list(read_trace(path))
    assert [(r.job, r.seq, r.step, r.layer) for r in records[:2]] == [
        ("doc-a", 5, 1, 0),
        ("doc-b", 6, 1, 0),
    ]
    assert [len(r.words[0]) for r in records[:2]] == [3, 2]
    for i, r in enumerate(records):
        mask = written[i // 2][i % 2]
        for h in range(2):
            want = torch.nonzero(mask[h, : r.num_pages]).flatten().tolist()
            assert r.pages(h) == want
            assert r.words[h] == tuple(pack_bits(mask[h, : r.num_pages]).tolist())
    assert len(load_streams(records)) == 2 * 2 * 2


def test_pages_from_words_matches_unpack():
    words = torch.tensor([-1, 0, -(2**31), 5], dtype=torch.int32)
    want = torch.nonzero(unpack_bits(words, 128)).flatten().tolist()
    assert pages_from_words(words.tolist()) == want


def test_replay_command(tmp_path):
    from hisparse_cli.replay_cmd import register

    path = _textbook_trace(tmp_path / "t.jsonl")
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps "replay" a subcommand
        pass

    out = tmp_path / "r.json"
    args = ["replay", str(path), "--device-buffer-pages", "3", "--buffer-multiple", "1,2"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "belady" in result.output
    data = json.loads(out.read_text())
    got = {(r["policy"], r["capacity_pages"]): r["misses"] for r in data["results"]}
    assert got[("belady", 3)] == 2 * 9 and got[("lru", 3)] == 2 * 12
    assert got[("fifo", 3)] == 2 * 15
    assert {c for _, c in got} == {3, 4, 8}
    bad = CliRunner().invoke(app, ["replay", str(path), "--policy", "mru"])
    assert bad.exit_code == 2
    # a pipe or a device is refused before it is opened (fresh-user finding: /dev/zero
    # filled the memory, a FIFO with no writer blocked forever)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.jsonl")
        for name in (str(tmp_path / "pipe.jsonl"), "/dev/zero"):
            if os.path.exists(name):
                refused = CliRunner().invoke(app, ["replay", name])
                text = " ".join(refused.output.replace("│", " ").split())  # the error box
                assert refused.exit_code == 2 and "is not a regular file (a pipe" in text


def test_stage_traces_replay_as_one(tmp_path):
    """Two pipeline stages' files (layers 0 and 1) read as one trace: the merged header
    holds every layer and the CLI replays them together; a header that disagrees or a
    file given twice is refused."""
    from engine.measure.trace import merge_headers, read_traces
    from hisparse_cli.replay_cmd import register

    paths = []
    for layer in (0, 1):
        path = tmp_path / f"run.w{layer}.jsonl"
        writer = TraceWriter(path, header(layers=(layer, layer + 1)))
        writer.bind({0: "doc"})
        for step, sel in enumerate(TEXTBOOK):
            mask = torch.zeros(1, 2, 8, dtype=torch.bool)
            mask[0, :, sel] = True
            writer(fake_plan([0], [8], step), layer, pack_bits(mask))
        writer.close()
        paths.append(path)
    assert read_header(paths[1]).layers == (1, 2)
    merged, records = read_traces(paths)
    assert merged == header()  # layers None: every layer
    streams = load_streams(records)
    assert sorted(streams) == [("doc", 0, layer, h) for layer in (0, 1) for h in (0, 1)]
    assert replay_trace(paths, [3], ["lru"])[1][0].misses == 4 * 12
    assert merge_headers([header(layers=(0, 1))], ["a"]).layers == (0, 1)
    with pytest.raises(ValueError, match="top_k=128"):
        merge_headers([header(), header(top_k=128)], ["a", "b"])
    with pytest.raises(ValueError, match="twice"):
        read_traces([paths[0], paths[0]])
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:
        pass

    out = tmp_path / "r.json"
    args = ["replay", *map(str, paths), "--device-buffer-pages", "3", "--policy", "lru"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["trace"] == [str(p) for p in paths] and data["results"][0]["misses"] == 4 * 12


def _replay_app() -> typer.Typer:
    from hisparse_cli.replay_cmd import register

    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps "replay" a subcommand
        pass

    return app


def _textbook_trace(path):
    writer = TraceWriter(path, header())
    for step, sel in enumerate(TEXTBOOK):
        mask = torch.zeros(1, 2, 8, dtype=torch.bool)
        mask[0, :, sel] = True
        writer(fake_plan([0], [8], step), 0, pack_bits(mask))
    writer.close()
    return path


@pytest.mark.parametrize("damage", ["cut_off", "not_json", "not_a_record"])
def test_replay_names_file_and_line_of_a_bad_record(tmp_path, damage):
    """A record cut off mid-write (the run was killed), or any bad line, is reported as
    file:line, as a clean error (exit 2)."""
    path = _textbook_trace(tmp_path / "t.jsonl")
    lines = path.read_text().splitlines()
    if damage == "cut_off":
        text = "\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2]
        bad_line, phrase = len(lines) + 1, "cut off"
    elif damage == "not_json":
        text = "\n".join([*lines[:3], "{oops", *lines[3:]]) + "\n"
        bad_line, phrase = 4, "not valid JSON"
    else:
        text = "\n".join([*lines[:5], '{"job": "doc", "seq": 0}', *lines[5:]]) + "\n"
        bad_line, phrase = 6, "'step'"
    path.write_text(text)
    result = CliRunner().invoke(_replay_app(), ["replay", str(path)], catch_exceptions=False)
    assert result.exit_code == 2
    assert f"error: {path}:{bad_line}: " in result.output and phrase in result.output
    with pytest.raises(ValueError, match=f"{path}:{bad_line}: "):
        list(read_trace(path))


def test_replay_names_a_cut_off_gzip_trace(tmp_path):
    path = _textbook_trace(tmp_path / "t.jsonl.gz")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # the gzip stream ends early
    result = CliRunner().invoke(_replay_app(), ["replay", str(path)], catch_exceptions=False)
    assert result.exit_code == 2 and f"error: {path}:" in result.output


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--buffer-multiple", "0"], "--buffer-multiple"),
        (["--buffer-multiple", "-1"], "--buffer-multiple"),
        (["--buffer-multiple", "1,0"], "--buffer-multiple"),
        (["--buffer-multiple", "nan"], "--buffer-multiple"),
        (["--buffer-multiple", "inf"], "--buffer-multiple"),
        (["--buffer-multiple", "two"], "--buffer-multiple"),
        (["--device-buffer-pages", "0"], "--device-buffer-pages"),
        (["--device-buffer-pages", "-3"], "--device-buffer-pages"),
    ],
)
def test_replay_rejects_buffer_sizes_that_are_not_positive(tmp_path, args, phrase):
    path = _textbook_trace(tmp_path / "t.jsonl")
    app = _replay_app()
    result = CliRunner().invoke(app, ["replay", str(path), *args], catch_exceptions=False)
    assert result.exit_code == 2 and phrase in result.output
    assert "belady" not in result.output  # nothing was replayed


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lru_replay_equals_engine_counts(tmp_path, smollm2_gguf_path, corpus_dir):
    """A real-model run with --trace: LRU replay of the trace at the engine's
    device_buffer reproduces each job's CacheStats exactly."""
    from engine.config import EngineConfig, SamplingParams
    from engine.events import Job, JobFinished
    from engine.load import load_engine

    doc = corpus_dir / "howto-sorting.txt"
    if not doc.exists():
        pytest.skip(f"corpus document {doc} missing")
    path = tmp_path / "trace.jsonl"
    cfg = EngineConfig(
        attention="sparse",
        indexer="quest",
        page_size=16,
        top_k=128,
        device_buffer=160,
        host_pool_gb=0.25,
        max_batch=2,
        trace_path=str(path),
    )
    eng = load_engine(cfg, str(smollm2_gguf_path))
    tok = eng.tokenizer
    body = tok.decode(tok.encode(doc.read_text(encoding="utf-8"))[:1000])
    chats = ["Summarize this document:\n\n" + body, "Name three sorting algorithms."]
    sampling = SamplingParams(max_tokens=17)
    jobs = [
        Job(f"job{i}", tuple(tok.encode_chat([{"role": "user", "content": c}])), sampling)
        for i, c in enumerate(chats)
    ]
    stats = {e.result.job_id: e.result.cache for e in eng.run(jobs) if isinstance(e, JobFinished)}
    assert set(stats) == {"job0", "job1"}
    streams = load_streams(read_trace(path))
    assert read_header(path).device_buffer_pages == cfg.buffer_pages == 10
    for job_id, cache in stats.items():
        mine = {k: v for k, v in streams.items() if k[0] == job_id}
        assert len(mine) == 30 * 3
        lru = replay(mine, cfg.buffer_pages, "lru")
        assert cache.misses > 0
        assert (lru.misses, lru.hits) == (cache.misses, cache.hits), job_id
    _, results = replay_trace(path, [cfg.buffer_pages], ["lru", "belady"])
    assert results[1].misses <= results[0].misses
