"""``--context-policy chunk``: a document over the context limit becomes map jobs on
overlapping chunks, run in the batch with the other jobs, then a reduce job over their
results (chunked again while too long); resume reads only the job's own line."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from engine.text.context import CHUNK_SLACK, chunk_document, reduce_document
from hisparse_cli import runner as runner_module
from hisparse_cli import testing
from hisparse_cli.dashboard import chunk_parts
from hisparse_cli.tasks import TaskSpec, build_messages

TOKEN_PARTS = (
    "map_prompt_tokens", "map_generated_tokens", "reduce_prompt_tokens", "reduce_generated_tokens",
)  # fmt: skip
LIMIT = 160  # the fake engine's context limit (tokens = words)
PART_CACHE = {"hits": 12, "misses": 4, "hit_rate": 0.75, "prefetched": 0, "h2d_bytes": 65536}
"""The fake engine's hot-buffer traffic for a part of 4 tokens (3 hits, 1 miss and 16 KiB
copied a token)."""
WORDS = 400


class WordTokenizer(testing.FakeTokenizer):
    """Reversible: one id per distinct word."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text):
        out = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            out.append(self.vocab[w])
        return out

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def messages_of(text):
    return build_messages(TaskSpec("summarize"), text, "long", "long.txt")


def check_chunks(tok, chunks):
    """Each chunk's prompt fits (8 new tokens) and holds contiguous words ``w<i>``:
    ``(window, [(first, last) word of each chunk])``."""
    template = len(tok.encode_chat(messages_of("")))
    spans = []
    for text in chunks:
        assert len(tok.encode_chat(messages_of(text))) + 8 <= LIMIT
        ids = [int(w[1:]) for w in text.split()]
        assert ids == list(range(ids[0], ids[-1] + 1))  # contiguous
        spans.append((ids[0], ids[-1]))
    return LIMIT - 8 - template - CHUNK_SLACK, spans


def test_chunks_fit_cover_the_document_in_order_and_overlap():
    tok = WordTokenizer()
    words = [f"w{i}" for i in range(WORDS)]
    chunks = chunk_document(tok, messages_of, " ".join(words), LIMIT, 8, overlap=0.1)
    assert len(chunks) > 3
    window, spans = check_chunks(tok, chunks)
    assert spans[0][0] == 0 and spans[-1][1] == WORDS - 1
    for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
        assert e0 - s1 + 1 == window - int(window * 0.9)  # 10% of a window repeated
    assert chunk_document(tok, messages_of, "short text", LIMIT, 8) == ["short text"]
    with pytest.raises(ValueError, match="no room for a chunk"):
        chunk_document(
            tok, messages_of, " ".join(words), len(tok.encode_chat(messages_of(""))) + 20, 8
        )
    reduced = reduce_document(["one", "two"])
    assert "[part 1 of 2]\none" in reduced and reduced.index("one") < reduced.index("two")


def test_a_huge_document_tokenised_in_pieces_is_chunked_whole_in_order_with_the_overlap(
    monkeypatch,
):
    """A document far over the context by its size is tokenised in pieces (here of 200
    characters, cut at line starts): its chunks still cover it in order, contiguous, each
    starting 90% of a window after the previous one across the pieces' edges, as the
    chunks of the whole document's ids; it is never tokenised or rendered whole."""
    from engine.text import context

    tok, encoded = WordTokenizer(), []
    encode = tok.encode

    def counting(text):
        encoded.append(len(text))
        return encode(text)

    monkeypatch.setattr(tok, "encode", counting)
    n = 4000  # 23 KB: over 32 characters a token of the room (152 + 256 tokens)
    document = "\n".join(
        " ".join(f"w{i}" for i in range(at, min(n, at + 7))) for at in range(0, n, 7)
    )
    monkeypatch.setattr(context, "CHUNK_PIECE_CHARS", 200)
    chunks = chunk_document(tok, messages_of, document, LIMIT, 8, overlap=0.1)
    assert isinstance(chunks, context.TokenChunks) and max(encoded) < len(document) / 8
    window, spans = check_chunks(tok, chunks)
    assert spans[0][0] == 0 and spans[-1][1] == n - 1
    for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
        assert e0 - s1 + 1 == window - int(window * 0.9)  # 10% of a window repeated
    monkeypatch.setattr(context, "CHUNK_PIECE_CHARS", 10**9)
    assert list(chunks) == chunk_document(tok, messages_of, document, LIMIT, 8, overlap=0.1)
    # over the size bound, yet one token (more than 32 characters a token): it fits whole
    for piece_chars in (10**9, 200):
        monkeypatch.setattr(context, "CHUNK_PIECE_CHARS", piece_chars)
        assert chunk_document(tok, messages_of, "x" * 20_000, LIMIT, 8) == ["x" * 20_000]


def test_piece_ids_keep_ids_of_any_size():
    """A huge document's ids are kept in 2 bytes each where they fit, else in 4."""
    from engine.text.context import piece_ids

    document = "ab cd\nef gh " * 50
    for scale, dtype in ((1, "uint16"), (1000, "int32")):  # ids up to 104 / 104,000

        def encode(text, scale=scale):
            return [ord(c) * scale for c in text]

        ids = piece_ids(encode, document, 16)
        assert len(ids.pieces) > 20 and {p.dtype.name for p in ids.pieces} == {dtype}
        assert ids.take(0, len(ids)) == encode(document)
        assert ids.take(7, 40) == encode(document)[7:40] and ids.take(10, 10) == []


@pytest.fixture
def long_doc(docs):
    (docs / "long.txt").write_text(" ".join(f"word{i}" for i in range(WORDS)) + "\n")
    return docs


def read_lines(tmp_path):
    path = tmp_path / "hisparse-out" / "results.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def run_chunked(cli, *args, **engine_kwargs):
    factory = testing.fake_engine_factory(limit=LIMIT, **engine_kwargs)
    result = cli(
        "docs/alpha.txt",
        "docs/long.txt",
        "docs/beta.txt",
        "--context-policy",
        "chunk",
        "--max-new-tokens",
        "4",
        "--max-batch",
        "3",
        *args,
        engine=factory,
    )
    seen = [job for engine in factory.engines for job in engine.seen]
    return result, seen


def test_long_document_maps_then_reduces_in_the_batch(cli, long_doc, tmp_path):
    result, seen = run_chunked(cli)
    assert result.exit_code == 0, result.output
    ids = [j.id for j in seen]
    maps = [i for i in ids if i.startswith("long@1.")]
    assert len(maps) >= 3 and ids.index("long") > max(ids.index(m) for m in maps)
    assert ids[:2] == ["alpha", maps[0]] and "beta" in ids  # batched with the others
    assert all(len(j.prompt_ids) + 4 <= LIMIT for j in seen)
    # The reduce prompt: the task over the map results, in order.
    texts = [f"output of {m}: 4 tokens" for m in maps]
    reduce_ids = testing.FakeTokenizer().encode_chat(
        build_messages(TaskSpec("summarize"), reduce_document(texts), "long", "long.txt")
    )
    assert next(j for j in seen if j.id == "long").prompt_ids == tuple(reduce_ids)
    records = {r["id"]: r for r in read_lines(tmp_path)}
    assert set(records) == {"alpha", "long", "beta"}  # map jobs get no results line
    assert records["long"]["ok"] and records["long"]["chunked"] == {
        "policy": "chunk",
        "chunks": len(maps),
        "levels": 1,
        "per_level": [len(maps)],
        **{k: records["long"]["chunked"][k] for k in TOKEN_PARTS},  # their test is below
        "reduce_ttft_s": 0.01,  # the fake engine's; the job's own counts from its first map
        "reduce_prefill_tok_s": 1000.0,  # the fake engine's rates
        "reduce_decode_tok_s": 100.0,
        "reduce_cache": PART_CACHE,
    }
    assert records["long"]["ttft_s"] > records["long"]["chunked"]["reduce_ttft_s"]
    assert records["long"]["started_at"] <= records["alpha"]["finished_at"]  # with its maps
    assert "chunked" not in records["alpha"]
    assert (tmp_path / "hisparse-out" / "long.txt").read_text() == "output of long: 4 tokens"
    assert f"the task runs on {len(maps)} overlapping chunks" in result.output
    assert re.search(r"jobs ok\s+│ 3 ", result.output)  # the map jobs are not counted
    # Resume: the job's line is what counts; nothing runs again.
    again, seen = run_chunked(cli)
    assert again.exit_code == 0 and seen == []


def test_the_documents_line_and_the_summary_count_every_part_s_tokens(cli, long_doc, tmp_path):
    result, seen = run_chunked(cli, "--json-progress")
    assert result.exit_code == 0, result.output
    maps = [j for j in seen if j.id.startswith("long@")]
    reduce = next(j for j in seen if j.id == "long")
    record = {r["id"]: r for r in read_lines(tmp_path)}["long"]
    map_prompt = sum(len(j.prompt_ids) for j in maps)
    assert record["prompt_tokens"] == map_prompt + len(reduce.prompt_ids)
    assert record["generated_tokens"] == 4 * (len(maps) + 1)  # every job writes 4 tokens
    assert record["chunked"] == {
        "policy": "chunk", "chunks": len(maps), "levels": 1, "per_level": [len(maps)],
        "map_prompt_tokens": map_prompt, "map_generated_tokens": 4 * len(maps),
        "reduce_prompt_tokens": len(reduce.prompt_ids), "reduce_generated_tokens": 4,
        "reduce_ttft_s": record["chunked"]["reduce_ttft_s"],
        "reduce_prefill_tok_s": 1000.0, "reduce_decode_tok_s": 100.0,
        "reduce_cache": PART_CACHE,
    }  # fmt: skip
    # every part at the fake engine's rates: the whole document's are the same
    assert record["prefill_tok_s"] == pytest.approx(1000.0)
    assert record["decode_tok_s"] == pytest.approx(100.0)
    events = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    finished = next(e for e in events if e["event"] == "job_finished" and e["job_id"] == "long")
    assert finished["prompt_tokens"] == record["prompt_tokens"]  # as the results line
    assert finished["generated_tokens"] == record["generated_tokens"]
    assert finished["chunk_parts"] == len(maps)
    assert (finished["ttft_s"], finished["prefill_tok_s"]) == (
        record["ttft_s"], record["prefill_tok_s"],
    )  # fmt: skip
    summary = next(json.loads(x) for x in result.stdout.splitlines() if '"event": "summary"' in x)
    assert summary["prompt_tokens"] == sum(len(j.prompt_ids) for j in seen)  # maps included
    assert summary["generated_tokens"] == 4 * len(seen)
    assert summary["ok"] == 3


def test_map_jobs_send_chunk_part_finished_objects_not_job_finished(cli, long_doc, tmp_path):
    """With ``--json-progress`` a map job's end is a ``chunk_part_finished`` object (its
    job's id, level, index, tokens); ``job_finished`` objects are one per job asked for.
    Before, each map job sent a ``job_finished`` of its own (a trial counted 7 for one
    job); a failed map job's ``job_failed`` is its job's only."""
    result, seen = run_chunked(cli, "--json-progress")
    assert result.exit_code == 0, result.output
    events = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    finished = [e["job_id"] for e in events if e["event"] == "job_finished"]
    assert sorted(finished) == ["alpha", "beta", "long"]
    maps = [j for j in seen if j.id.startswith("long@")]
    parts = sorted(
        (e for e in events if e["event"] == "chunk_part_finished"), key=lambda e: e["index"]
    )
    assert [(e["job_id"], e["part_id"], e["level"], e["index"]) for e in parts] == [
        ("long", m.id, 1, i) for i, m in enumerate(maps, 1)
    ]
    assert [e["prompt_tokens"] for e in parts] == [len(m.prompt_ids) for m in maps]
    assert {(e["generated_tokens"], e["finish_reason"], e["error"]) for e in parts} == {
        (4, "length", "")
    }
    failing, _ = run_chunked(cli, "--json-progress", "--force", fail={maps[1].id: "oom"})
    events = [json.loads(x) for x in failing.stdout.splitlines() if x.startswith("{")]
    failed = [e for e in events if e["event"] == "job_failed"]
    assert [e["job_id"] for e in failed] == ["long"]
    (part,) = [e for e in events if e["event"] == "chunk_part_finished" and e["error"]]
    assert (part["part_id"], part["finish_reason"], part["error"]) == (maps[1].id, "error", "oom")
    args = ("--json-progress", "--force", "--max-batch", "1")  # Ctrl-C: long's maps unadmitted
    stopped, _ = run_chunked(cli, *args, on_step=interrupt_at(1))
    events = [json.loads(x) for x in stopped.stdout.splitlines() if x.startswith("{")]
    parts = [e for e in events if e["event"] == "chunk_part_finished"]
    assert len(parts) == len(maps) and {e["finish_reason"] for e in parts} == {"cancelled"}


class MapIds(set):
    """Every map job of ``long`` (``audit_disagree`` of the fake engine)."""

    def __contains__(self, job_id):
        return job_id.startswith("long@")


def test_the_documents_cache_and_audit_count_every_part(cli, long_doc, tmp_path):
    """The line's ``cache`` is every part's hot-buffer traffic summed (map jobs and
    reduce), its ``audit`` every part's audited steps (counts summed, means and the flag
    recomputed from the sums); the reduce step's own are kept in ``chunked``. Before, both
    were the reduce step's only: here a clean reduce hid map jobs that all disagreed."""
    args = ("--json-progress", "--audit", "2")
    result, seen = run_chunked(cli, *args, audit_disagree=MapIds())
    assert result.exit_code == 0, result.output
    parts = 1 + len([j for j in seen if j.id.startswith("long@")])
    record = {r["id"]: r for r in read_lines(tmp_path)}["long"]
    whole = {k: v * parts for k, v in PART_CACHE.items() if k != "hit_rate"}
    assert record["cache"] == {**whole, "hit_rate": 0.75}
    assert record["chunked"]["reduce_cache"] == PART_CACHE
    audit = record["audit"]  # 2 steps a part; the map jobs' disagree (KL 2.0, mass 0.5)
    assert audit["steps"] == 2 * parts and audit["kl_max"] == 2.0
    assert audit["top1_agreement"] == pytest.approx(1 / parts)
    assert audit["kl_mean"] == pytest.approx((2.0 * (parts - 1) + 0.01) / parts)
    assert audit["mass_kept_mean"] == pytest.approx((0.5 * (parts - 1) + 0.95) / parts)
    assert audit["seconds"] == pytest.approx(0.002 * parts)
    assert audit["flagged"] and "top-1 agreement with dense" in audit["flag_reason"]
    assert "long: audit flagged over" in result.output
    reduce = record["chunked"]["reduce_audit"]
    assert (reduce["steps"], reduce["top1_agreement"], reduce["kl_mean"]) == (2, 1.0, 0.01)
    events = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    finished = next(e for e in events if e["event"] == "job_finished" and e["job_id"] == "long")
    assert finished["cache"]["hits"] == record["cache"]["hits"]  # as the results line
    assert finished["audit"]["steps"] == audit["steps"]


def test_reduce_is_chunked_again_while_too_long(cli, long_doc, tmp_path):
    first = run_chunked(cli)[1]
    maps = [j.id for j in first if j.id.startswith("long@1.")]
    wordy = {m: " ".join(["result"] * 40) for m in maps}  # joined: over the limit
    result, seen = run_chunked(cli, "--force", texts=wordy)
    assert result.exit_code == 0, result.output
    ids = [j.id for j in seen]
    level2 = [i for i in ids if i.startswith("long@2.")]
    assert level2 and ids.index("long") > max(map(ids.index, level2))
    record = [r for r in read_lines(tmp_path) if r["id"] == "long"][-1]
    assert record["ok"] and record["chunked"]["levels"] == 2
    assert record["chunked"]["per_level"] == [len(maps), len(level2)]


def test_a_failed_map_job_fails_its_job_only_and_resume_redoes_it(cli, long_doc, tmp_path):
    maps = [j.id for j in run_chunked(cli)[1] if j.id.startswith("long@1.")]
    result, seen = run_chunked(cli, "--force", fail={maps[1]: "out of memory"})
    assert result.exit_code == 1
    assert "long" not in [j.id for j in seen]  # no reduce
    records = {r["id"]: r for r in read_lines(tmp_path)[3:]}
    assert records["alpha"]["ok"] and records["beta"]["ok"]
    assert not records["long"]["ok"]
    assert records["long"]["error"] == f"chunk {maps[1]} failed: out of memory"
    assert records["long"]["chunked"]["chunks"] == len(maps)
    again, seen = run_chunked(cli)
    assert again.exit_code == 0
    assert [j.id for j in seen] == [*maps, "long"]  # only the failed job, map and reduce


def interrupt_at(step_no):
    def on_step(step):
        if step == step_no:
            os.kill(os.getpid(), signal.SIGINT)

    return on_step


@pytest.mark.parametrize("batch", ["3", "1"])  # map jobs running / long's maps still queued
def test_ctrl_c_during_map_jobs_records_the_job_as_cancelled(cli, long_doc, tmp_path, batch):
    result, seen = run_chunked(cli, "--max-batch", batch, on_step=interrupt_at(1))
    assert result.exit_code == 130, result.output
    records = {r["id"]: r for r in read_lines(tmp_path)}
    assert "long" not in [j.id for j in seen]  # no reduce
    # every job the summary counts as cancelled has its line: beta and (batch 1) long were
    # handed to the engine but never admitted
    assert "│ 3 / 0" in result.stdout  # cancelled / not run
    assert {r["finish_reason"] for r in records.values()} == {"cancelled"}
    assert records["beta"]["error"] == "cancelled before admission"
    if batch == "1":  # alpha ran alone: long's map jobs were queued, none started
        assert set(records) == {"alpha", "beta", "long"}
        long = records["long"]
        assert long["error"] == "cancelled before any of its map jobs was admitted"
        assert long["generated_tokens"] == 0 and long["chunked"]["chunks"] >= 3
        again, seen = run_chunked(cli)
        assert again.exit_code == 0 and "long" in [j.id for j in seen]
        return
    assert set(records) == {"alpha", "beta", "long"}
    long = records["long"]
    assert long["finish_reason"] == "cancelled" and not long["ok"]
    assert long["chunked"]["chunks"] >= 3 and long["chunked"]["map_prompt_tokens"] > 0
    assert long["error"] == "cancelled at chunk level 1 (map jobs); no reduce step ran"
    assert long["cache"]["hits"] == 3 * long["generated_tokens"]  # the map jobs that ran
    again, seen = run_chunked(cli)  # resume redoes the whole job
    assert again.exit_code == 0 and "long" in [j.id for j in seen]


def test_ctrl_c_during_the_reduce_records_the_job_as_cancelled(cli, long_doc, tmp_path):
    maps = [j.id for j in run_chunked(cli)[1] if j.id.startswith("long@1.")]
    map_steps = 3 * -(-(len(maps) + 2) // 3)  # batches of 3 (alpha, maps, beta), 3 steps each
    result, seen = run_chunked(cli, "--force", on_step=interrupt_at(map_steps + 1))
    assert result.exit_code == 130, result.output
    assert seen[-1].id == "long"  # the reduce was running
    record = {r["id"]: r for r in read_lines(tmp_path)[3:]}["long"]
    assert record["finish_reason"] == "cancelled"
    assert record["chunked"]["map_generated_tokens"] == 4 * len(maps)
    assert record["chunked"]["reduce_generated_tokens"] == 2


def test_progress_counts_the_jobs_asked_for_and_a_chunked_job_s_whole_tokens(
    cli, long_doc, tmp_path
):
    result, seen = run_chunked(cli)
    assert result.exit_code == 0, result.output
    record = {r["id"]: r for r in read_lines(tmp_path)}["long"]
    maps = [j for j in seen if j.id.startswith("long@")]
    line = r"done long: (\d+) tokens in, (\d+) out \(length; (\d+) chunk parts"
    done = re.search(line, result.output)
    assert done, result.output
    assert int(done[1]) == record["prompt_tokens"] and int(done[2]) == record["generated_tokens"]
    assert int(done[3]) == len(maps)


def test_the_job_total_stays_what_was_asked_while_map_jobs_come_and_go():
    from engine.events import JobAdmitted, JobQueued, PrefillProgress
    from hisparse_cli.progress import ProgressTracker
    from hisparse_cli.reporters import progress_line

    tracker = ProgressTracker(0.0)
    for job_id in ("long", "small"):
        tracker.add_job(job_id)
    totals = []
    tracker.add_parts("long", ["long@1.1", "long@1.2"])
    for i in (1, 2):
        tracker.update(JobQueued(0.1, f"long@1.{i}", 100))
    tracker.update(JobAdmitted(0.2, "long@1.1", 100))
    tracker.update(PrefillProgress(0.3, "long@1.1", 1, 2, 100))
    totals.append(progress_line(tracker.state, 1.0))
    tracker.retire_part("long@1.1")
    totals.append(progress_line(tracker.state, 1.0))
    tracker.retire_part("long@1.2")
    totals.append(progress_line(tracker.state, 1.0))
    assert all("jobs 0/2 ended" in line for line in totals), totals
    assert "chunk parts 0 done, 1 running, 1 queued" in totals[0]
    assert "chunk parts 0 done, 0 running, 1 queued" in totals[1]  # retired unfinished: not done
    assert "chunk parts" not in totals[2]
    assert tracker.state.jobs["long"].part_prompt_tokens == 100  # long@1.2 never ran
    assert tracker.state.map_prompt_tokens == 100  # the run's totals, as before


def test_a_chunked_job_s_rates_are_the_whole_document_s():
    """Fresh-user finding: a chunked job's results line gave the reduce step's prefill rate
    (178 tok/s over its 209 tokens) beside the document's 12,741 prompt tokens, which took
    264 s. The line's rates are now all tokens over all seconds of its parts (map jobs and
    reduce), the reduce step's own kept in ``chunked``."""
    from hisparse_cli.chunking import ChunkScheduler

    chunker = ChunkScheduler(lambda job_id, document: [])
    chunker.maps("doc", 2)
    chunker.count("doc@1.1", 4000, 11, (100.0, 10.0))  # 40 s prefill, 1 s decode
    chunker.count("doc@1.2", 2000, 21, (50.0, 5.0))  # 40 s prefill, 4 s decode
    state = chunker.jobs["doc"]
    prefill, decode = state.whole_rates(200, 200.0, 6, 5.0)  # 1 s prefill, 1 s decode
    assert prefill == pytest.approx(6200 / 81)  # not the reduce step's 200
    assert decode == pytest.approx((10 + 20 + 5) / 6)
    record = state.attribute({"prompt_tokens": 200, "generated_tokens": 6})
    assert record["prompt_tokens"] == 6200 and record["generated_tokens"] == 38
    parts = record["chunked"]
    assert (parts["reduce_prefill_tok_s"], parts["reduce_decode_tok_s"]) == (200.0, 5.0)
    # a map job that failed counts its tokens and no time
    chunker.count("doc@1.1", 10, 0)
    assert state.map_prefill_s == pytest.approx(80.0) and state.map_prompt_tokens == 6010


class Recorded:
    """Chunks (a sequence), recording each text read; the text ``fail_at`` raises."""

    def __init__(self, chunks, reads, fail_at=None):
        self.chunks, self.reads, self.fail_at = chunks, reads, fail_at

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, i):
        self.reads.append(i)
        if i == self.fail_at:
            raise ValueError("no such text")
        return self.chunks[i]


class OneAtATime(testing.FakeEngine):
    """Draws a job only when the one before it has ended (the real engine draws one when
    there is room), recording ``(job id, chunk texts read by then, the progress line's
    chunk parts then)``."""

    def run(self, jobs):
        for job in jobs:
            if job is not None:
                parts = chunk_parts(self.trackers[-1].state)
                self.drawn.append((job.id, len(self.reads), parts))
                yield from testing.FakeEngine.run(self, [job])


def run_one_at_a_time(cli, monkeypatch, fail_at=None, engine_class=None, **engine_kwargs):
    """The three documents under ``chunk`` with :class:`OneAtATime` (or ``engine_class``),
    the chunk texts :class:`Recorded`. Returns the result, the jobs drawn and the run's
    progress state."""
    reads, drawn, trackers = [], [], []
    monkeypatch.setattr(
        runner_module,
        "chunk_document",
        lambda *a, **k: Recorded(chunk_document(*a, **k), reads, fail_at),
    )

    class Tracker(runner_module.ProgressTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trackers.append(self)

    monkeypatch.setattr(runner_module, "ProgressTracker", Tracker)

    def load(config, model, job_tokens=None):
        engine = (engine_class or OneAtATime)(config=config, limit=LIMIT, **engine_kwargs)
        engine.drawn, engine.reads, engine.trackers = drawn, reads, trackers
        return engine

    args = ("docs/alpha.txt", "docs/long.txt", "docs/beta.txt", "--context-policy", "chunk")
    result = cli(*args, "--max-new-tokens", "4", engine=load)
    return result, drawn, trackers[-1].state


def test_map_jobs_are_built_as_the_engine_draws_them(cli, long_doc, tmp_path, monkeypatch):
    """The map jobs of a huge document (tens of thousands, each with its chunk's text
    and prompt ids) are not all built at once: a chunk's text is read and its job built
    only when the engine draws it, and the level still ends, and reduces, only when every
    map job has finished."""
    result, drawn, state = run_one_at_a_time(cli, monkeypatch)
    assert result.exit_code == 0, result.output
    maps = [(job, read, parts) for job, read, parts in drawn if job.startswith("long@1.")]
    assert len(maps) >= 3 and [read for _, read, _ in maps] == list(range(1, len(maps) + 1))
    assert [job for job, _, _ in drawn] == ["alpha", *(m for m, _, _ in maps), "long", "beta"]
    # the progress line counts every map job of the level from the start, built or not
    assert maps[0][2] == f"; chunk parts 0 done, 0 running, {len(maps)} queued"
    assert maps[-1][2] == f"; chunk parts {len(maps) - 1} done, 0 running, 1 queued"
    assert chunk_parts(state) == ""
    record = {r["id"]: r for r in read_lines(tmp_path)}["long"]
    assert record["ok"] and record["chunked"]["chunks"] == len(maps)
    assert f"the task runs on {len(maps)} overlapping chunks" in result.output


@pytest.mark.parametrize("how", ["engine", "prompt"])
def test_no_map_job_is_built_once_one_failed(cli, long_doc, tmp_path, monkeypatch, how):
    """A map job that fails (in the engine, or its prompt cannot be built) fails its job,
    and none of the job's later map jobs is built; the batch goes on."""
    fail = {"fail": {"long@1.2": "out of memory"}} if how == "engine" else {}
    result, drawn, state = run_one_at_a_time(cli, monkeypatch, None if fail else 1, **fail)
    assert result.exit_code == 1, result.output
    ids = [job for job, _, _ in drawn]
    assert ids == ["alpha", "long@1.1", *(["long@1.2"] if fail else []), "beta"]
    assert chunk_parts(state) == ""  # the map jobs never built left the progress line
    records = {r["id"]: r for r in read_lines(tmp_path)}
    assert records["alpha"]["ok"] and records["beta"]["ok"] and not records["long"]["ok"]
    why = "out of memory" if fail else "cannot prepare its prompt: no such text"
    assert records["long"]["error"] == f"chunk long@1.2 failed: {why}"


class Watched(OneAtATime):
    """Records, at each decode step, the job running and what the progress displays show
    then (:attr:`snaps`)."""

    snaps: list = []

    def _step_event(self, running, step):
        from hisparse_cli.dashboard import render_jobs
        from hisparse_cli.reporters import progress_json, progress_line

        state = self.trackers[-1].state
        shown = progress_json(state, state.last_t)
        table = _text(render_jobs(state, state.last_t))
        self.snaps.append(
            {
                "running": running[0].job.id,
                **{k: shown.get(k) for k in ("jobs", "chunk_parts", "chunked")},
                "line": progress_line(state, state.last_t),
                "long": next(x for x in table.splitlines() if "│ long " in x),
            }
        )
        return testing.FakeEngine._step_event(self, running, step)


def _text(renderable):
    from rich.console import Console

    console = Console(record=True, width=160, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_chunked_job_runs_from_its_first_map_job_and_counts_its_parts_done(
    cli, long_doc, tmp_path, monkeypatch
):
    """From its first map job's admission a chunked job is running (phase ``map``, with
    its level's map jobs done of all; then its reduce step), not ``queued``, and the map
    jobs that ended count as ``chunk_parts`` done: in the JSON progress object, the plain
    progress line and the dashboard. Before, it read ``queued`` until its reduce step was
    admitted and ``chunk_parts.done`` stayed 0."""
    monkeypatch.setattr(Watched, "snaps", [])
    result, drawn, state = run_one_at_a_time(cli, monkeypatch, engine_class=Watched)
    assert result.exit_code == 0, result.output
    n = len([job for job, _, _ in drawn if job.startswith("long@1.")])
    at = {}
    for snap in Watched.snaps:  # each job's first decode step (one job runs at a time)
        at.setdefault(snap["running"], snap)
    assert at["alpha"]["jobs"]["queued"] == 2 and at["alpha"]["chunked"] == {}  # not started
    for i in range(1, n + 1):
        snap = at[f"long@1.{i}"]
        assert snap["jobs"] == {
            "queued": 1, "map": 1, "prefill": 0, "decode": 0, "done": 1, "failed": 0,
            "cancelled": 0, "skipped": 0,
        }  # fmt: skip
        assert snap["chunk_parts"]["done"] == i - 1 and snap["chunk_parts"]["decode"] == 1
        assert snap["chunked"] == {"long": {"step": "map", "level": 1, "done": i - 1, "parts": n}}
        assert (
            f"jobs 1/3 ended (1 ok, 0 failed, 1 running, 1 queued; chunk parts {i - 1} "
            f"done, 1 running, {n - i} queued)"
        ) in snap["line"]
        assert f"chunked long map {i - 1}/{n}" in snap["line"]
        assert re.search(rf"│ map\s+│ .*{i - 1}/{n}", snap["long"]), snap["long"]
    reduce = at["long"]
    assert reduce["chunk_parts"]["done"] == n and reduce["jobs"]["decode"] == 1
    assert reduce["chunked"] == {"long": {"step": "reduce", "level": 1, "done": n, "parts": n}}
    assert "chunked long reduce" in reduce["line"] and "│ reduce " in reduce["long"]
    assert at["beta"]["chunked"] == {} and at["beta"]["chunk_parts"]["done"] == n


def test_the_dashboard_row_of_a_chunked_job_counts_its_whole_document():
    """Fresh-user finding: once a chunked job ended its dashboard row read ``in 166`` and
    ``8/8`` (its reduce step's) while its ``done`` line and results line said 3991 tokens
    in, 40 out. The row's tokens in and, once it ended, out are the whole document's."""
    from engine.events import FirstToken, JobAdmitted, JobFinished, JobQueued, JobResult
    from hisparse_cli.dashboard import finish_text, render_jobs
    from hisparse_cli.progress import ProgressTracker

    tracker = ProgressTracker(0.0)
    tracker.add_job("long")
    tracker.add_parts("long", ["long@1.1", "long@1.2"])
    for i, prompt in ((1, 992), (2, 815)):
        part = f"long@1.{i}"
        tracker.update(JobQueued(0.1, part, prompt))
        tracker.update(JobAdmitted(0.2, part, prompt))
        tracker.update(FirstToken(0.3, part, 0.1))
        tracker.update(JobFinished(0.5, JobResult(part, "x", tuple(range(16)), prompt, "length")))
        tracker.retire_part(part)
    row = tracker.state.jobs["long"]
    assert re.search(r"│ long\s+│\s+1,807 │ map ", _text(render_jobs(tracker.state, 0.6)))
    tracker.update(JobQueued(0.6, "long", 166))
    tracker.update(JobAdmitted(0.6, "long", 166))
    tracker.update(FirstToken(0.7, "long", 0.1))
    tracker.update(JobFinished(0.9, JobResult("long", "y", tuple(range(8)), 166, "length")))
    row.max_tokens = 8
    table = _text(render_jobs(tracker.state, 1.0))
    assert re.search(r"│ long\s+│\s+1,973 │ done\s+│ \S* ?40 out", table), table
    assert "long: 40 tokens (length)" in finish_text(row).plain


@pytest.mark.parametrize("batch", ["3", "1"])  # two of long's maps ran / none did
def test_ctrl_c_during_map_jobs_counts_the_tokens_of_the_parts_that_ran_only(
    cli, long_doc, tmp_path, batch
):
    """Fresh-user finding: a job cancelled during its map jobs had ``prompt_tokens`` of all
    its map jobs (992+992+992+815) while one only had prefilled. Its line, the JSON summary
    and its progress row count the prompt tokens of the map jobs that ran (their prefill
    reported progress): not those cancelled queued, or admitted but not yet prefilling."""
    from engine.events import JobAdmitted, JobFinished, JobQueued, JobResult
    from hisparse_cli.progress import ProgressTracker

    result, seen = run_chunked(
        cli, "--max-batch", batch, "--json-progress", on_step=interrupt_at(1)
    )
    assert result.exit_code == 130, result.output
    ran = [j for j in seen[1 : int(batch)] if j.id.startswith("long@")]  # admitted with alpha
    assert len(ran) == int(batch) - 1 and len(seen) > int(batch) + 1  # others were queued
    long = {r["id"]: r for r in read_lines(tmp_path)}["long"]
    prompt = sum(len(j.prompt_ids) for j in ran)
    assert long["chunked"]["map_prompt_tokens"] == prompt
    assert long["prompt_tokens"] == (prompt or None)
    summary = next(json.loads(x) for x in result.stdout.splitlines() if '"event": "summary"' in x)
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] or 0 for r in read_lines(tmp_path))
    # a map job admitted but cancelled before its prefill began counts no prompt tokens
    tracker = ProgressTracker(0.0)
    tracker.add_job("doc")
    tracker.add_parts("doc", ["doc@1.1"])
    tracker.update(JobQueued(0.1, "doc@1.1", 900))
    tracker.update(JobAdmitted(0.2, "doc@1.1", 900))
    tracker.update(JobFinished(0.3, JobResult("doc@1.1", "", (), 900, "cancelled")))
    tracker.retire_part("doc@1.1")
    assert tracker.state.jobs["doc"].part_prompt_tokens == tracker.state.map_prompt_tokens == 0


def test_a_chunked_job_s_own_job_queued_comes_once_with_its_map_jobs():
    """Fresh-user finding: with ``--json-progress`` a chunked job got no ``job_queued``
    under its own id until its reduce step (its map jobs had theirs). It comes once, just
    before its first map job's, with ``prompt_tokens`` null and ``chunk_parts``."""
    import io

    from engine.events import JobQueued
    from hisparse_cli.progress import ProgressTracker
    from hisparse_cli.reporters import JsonReporter

    tracker, stream = ProgressTracker(0.0), io.StringIO()
    reporter = JsonReporter(stream, tracker, interval_s=1e9, clock=lambda: 1.0)
    tracker.add_job("alpha")
    tracker.add_job("long")
    tracker.add_parts("long", ["long@1.1", "long@1.2"])
    for event in (
        JobQueued(0.1, "alpha", 50),
        JobQueued(0.2, "long@1.1", 150),
        JobQueued(0.3, "long@1.2", 120),
        JobQueued(0.9, "long", 40),  # its reduce step
    ):
        tracker.update(event)
        reporter.on_event(event)
    queued = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [(o["job_id"], o["prompt_tokens"], o.get("chunk_parts")) for o in queued] == [
        ("alpha", 50, None), ("long", None, 2), ("long@1.1", 150, None), ("long@1.2", 120, None),
    ]  # fmt: skip
    assert {o["event"] for o in queued} == {"job_queued"} and queued[1]["t"] == 0.2
