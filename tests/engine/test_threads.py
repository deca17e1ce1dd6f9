"""CPU threads: prefill runs on ``num_threads`` (torch's default when unset), decode steps on
``decode_threads`` (:class:`engine.config.EngineConfig`). ``hisparse run`` lowers only the
decode count on a busy machine, because the rounding of prefill's products depends on the
thread count and the decode step's does not: the answer stays an idle machine's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.events import Job, JobFinished

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_prefill_and_decode_each_run_on_their_own_thread_count(restore_threads, monkeypatch):
    from engine.load import load_engine

    eng = load_engine(
        EngineConfig(num_threads=2, decode_threads=1, max_batch=2, host_pool_gb=0.25,
                     page_size=16, top_k=48, device_buffer=96, prefill_chunk=64,
                     tokenizer="ids"),
        "synthetic:tiny",
    )
    seen: dict[str, set[int]] = {"prefill": set(), "decode": set()}
    qkv, plan = eng.model.qkv, eng.attn.plan

    def spy_qkv(layer, h, *args, **kwargs):  # a prefill chunk's projection (not a step's)
        if h.shape[0] > 2:  # chunks of 64 tokens (the last ones 8 and 22); steps of 1-2 rows
            seen["prefill"].add(torch.get_num_threads())
        return qkv(layer, h, *args, **kwargs)

    def spy_plan(*args, **kwargs):  # each decode step's attention plan
        seen["decode"].add(torch.get_num_threads())
        return plan(*args, **kwargs)

    monkeypatch.setattr(eng.model, "qkv", spy_qkv)
    monkeypatch.setattr(eng.attn, "plan", spy_plan)
    g = torch.Generator().manual_seed(0)
    jobs = [  # two jobs: the second one's prefill chunks run between the first's decode steps
        Job(f"j{i}", tuple(torch.randint(5, 40000, (n,), generator=g).tolist()),
            SamplingParams(max_tokens=6))
        for i, n in enumerate((200, 150))
    ]
    done = [e for e in eng.run(jobs) if isinstance(e, JobFinished)]
    assert len(done) == 2
    assert seen == {"prefill": {2}, "decode": {1}}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_the_decode_thread_count_leaves_the_real_models_answer_unchanged(
    smollm2_gguf_path, restore_threads
):
    """The embedded model with the quick start's weights (int4, bf16 products where the CPU
    has them) on the quick start's document: decoding on 1 thread or on 2 after the same
    prefill on 2 gives the same tokens. (Prefill on 1 thread instead of 2 changed this
    summary from its 5th token on, on the 2-core box of 2026-12-03.)"""
    from engine.load import load_engine

    text = (ROOT / "examples" / "howto-sorting.txt").read_text()
    answers = []
    for decode_threads in (1, 2):
        eng = load_engine(
            EngineConfig(num_threads=2, decode_threads=decode_threads, max_batch=1,
                         host_pool_gb=0.5, cpu_direct_reads=True),
            str(smollm2_gguf_path),
        )
        prompt = eng.tokenizer.encode_chat(
            [{"role": "user", "content": "Summarize:\n\n" + text[:6000]}]
        )
        job = Job("sorting", tuple(prompt), SamplingParams(max_tokens=24))
        [done] = [e for e in eng.run([job]) if isinstance(e, JobFinished)]
        answers.append(done.result.token_ids)
    assert answers[0] == answers[1]
