"""Host cost of the JSON constraint (``--fields``): per decode step of a constrained job.

Vocabularies: the embedded SmolLM2's (49,152 ids) and, as a stand-in for Qwen-sized
vocabularies (~150K), the same tokens three times over (147,456 ids: the same byte
strings, so the same states cost three times the candidates). Replies: realistic JSON
objects tokenised by the embedded tokenizer (pretty-printed and compact, strings with
escapes and non-ASCII, numbers, arrays), fed token by token as the engine feeds them.

Per step the engine calls ``JsonConstraint.allowed(tokens_left)`` (the mask of the next
token), then ``advance(token)``; on a batch it stacks the masks of the constrained rows
and takes their masked argmax (``engine.decode.sampling.masked_greedy``; on CUDA this
includes the upload of the ``[rows, V]`` bool masks). Reported: the one-time vocabulary
read, the first job's steps (cold: every new grammar state builds its mask), a second
job with the same keys (warm cache), the budget-tight final steps, and the masked argmax.

With ``--engine`` it also runs the embedded model (on CUDA when there is one) over a batch
of ``--batch`` copies of an extract prompt, greedy, ``--steps`` tokens each: once all free,
once with one job constrained to the keys (``Job.json_keys``); the mean step time of the
steady steps (whole batch, no prefill turn, no graph capture) of each shows what a
constrained row costs the batch (host mask, upload, masked argmax, and on CUDA the lost
chaining of steps).

Usage::

    python scripts/bench_json_mask.py [--rows 8] [--engine --batch 8 --steps 64] [--out bench_json_mask.json]

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from engine.decode.json_constraint import JsonConstraints
from engine.decode.sampling import masked_greedy
from engine.text.tokenizer import TextTokenizer
from engine.weights.embedded import default_model_path

KEYS = ("title", "authors", "year", "summary")
REPLIES = [
    {"title": "Sorting in \"practice\"", "authors": ["Ada Lovelace", "Émile Borel"],
     "year": 2024, "summary": "Quick sort, merge sort and heap sort compared on real data; "
     "the paper measures cache misses and branch mispredictions.\nIt finds 日本語 text sorts "
     "slower — 12.5% — because of multi-byte keys."},
    {"title": "Graphs and trees", "authors": [], "year": None,
     "summary": "A survey of spanning trees, shortest paths (Dijkstra, Bellman-Ford) and "
     "flows, with proofs sketched and 3 open problems listed."},
]  # fmt: skip


class _Repeated:
    """A tokenizer whose vocabulary is ``base``'s tokens ``times`` over (ids mod its size)."""

    def __init__(self, base: TextTokenizer):
        self.backend = base.backend
        self.text_vocab_size = base.vocab_size


def _texts() -> list[str]:
    out = []
    for reply in REPLIES:
        out.append(json.dumps(reply, ensure_ascii=False, indent=2))
        out.append(json.dumps(reply, ensure_ascii=False))
    return out


def _steps_us(constraints: JsonConstraints, ids: list[int]) -> list[float]:
    """Microseconds of ``allowed`` + ``advance`` per token of one reply (budget: exact)."""
    c = constraints.new(KEYS)
    times = []
    for k, token in enumerate(ids):
        t0 = time.perf_counter()
        mask = c.allowed(len(ids) - k + 8)  # 8 spare tokens: the last steps are budget-tight
        c.advance(token)
        times.append((time.perf_counter() - t0) * 1e6)
        assert mask is not None and bool(mask[token]), (k, token)
    assert c.done
    return times


def _summary(times: list[float]) -> dict:
    return {
        "steps": len(times),
        "mean_us": statistics.fmean(times),
        "median_us": statistics.median(times),
        "p99_us": sorted(times)[int(0.99 * (len(times) - 1))],
        "max_us": max(times),
        "total_ms": sum(times) / 1e3,
    }


def _masked_argmax_us(vocab_size: int, rows: int, device: str, overrule: bool) -> float:
    """``masked_greedy`` over ``rows`` constrained rows of a ``2 * rows`` batch; with
    ``overrule`` every mask excludes its row's argmax (the CPU's slow case)."""
    logits = torch.randn(max(rows, 1) * 2, vocab_size, device=device)
    greedy = logits.argmax(dim=-1)
    allowed = {}
    for i in range(rows):
        keep = torch.rand(vocab_size) < 0.5
        keep[int(greedy[i])] = not overrule
        allowed[i] = keep
    for _ in range(3):
        masked_greedy(logits, greedy, allowed)
    if device == "cuda":
        torch.cuda.synchronize()
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        out = masked_greedy(logits, greedy, allowed)
    if device == "cuda":
        out.cpu()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _engine_steps(batch: int, steps: int) -> dict:
    """Mean steady step time (ms) of ``batch`` greedy jobs, free and with one constrained."""
    from engine.config import EngineConfig, SamplingParams
    from engine.events import DecodeStep, Job, JobFinished
    from engine.load import load_engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = EngineConfig(device=device, dtype=dtype, kv_dtype=dtype, host_pool_gb=2.0,
                       max_batch=batch, num_threads=1)  # fmt: skip
    engine = load_engine(cfg)
    engine.eos_ids = frozenset()  # free jobs run their whole budget: the batch stays whole
    document = "Quarterly report, Acme Corp, Q3 2026. Revenue rose 12% to 4.1 million dollars."
    messages = [{"role": "user", "content": f"<document>\n{document}\n</document>\n\n"
                 f"Extract {', '.join(KEYS)} as one JSON object."}]  # fmt: skip
    prompt = tuple(engine.tokenizer.encode_chat(messages))
    out = {"device": device, "batch": batch, "steps": steps}
    for name, constrained in (("free", False), ("one_constrained", True)):
        jobs = [
            Job(f"j{i}", prompt, SamplingParams(max_tokens=steps),
                json_keys=KEYS if constrained and i == 0 else None)
            for i in range(batch)
        ]  # fmt: skip
        times, texts = [], {}
        for event in engine.run(jobs):
            if isinstance(event, DecodeStep):
                steady = not event.with_prefill and not getattr(event, "graph_capture", False)
                if steady and event.batch_size == batch:
                    times.append(event.step_s)
            elif isinstance(event, JobFinished):
                texts[event.result.job_id] = event.result.text
        out[name] = {"steady_steps": len(times), "mean_step_ms": 1e3 * statistics.fmean(times)
                     if times else None}  # fmt: skip
        if constrained:
            out["constrained_reply"] = texts.get("j0")
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="constrained rows in the masked argmax")
    ap.add_argument("--out", default="bench_json_mask.json")
    ap.add_argument("--engine", action="store_true", help="also time whole decode steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = TextTokenizer.from_gguf(default_model_path())
    replies = [tok.encode(t, special=False) for t in _texts()]
    results = []
    for name, source, size in [
        ("smollm2-49k", tok, tok.vocab_size),
        ("3x-smollm2-147k", _Repeated(tok), 3 * tok.vocab_size),
    ]:
        t0 = time.perf_counter()
        constraints = JsonConstraints(source, size)
        assert constraints.vocab.size == size  # read here, timed
        vocab_s = time.perf_counter() - t0
        masks = constraints.masks(KEYS)
        cold = _steps_us(constraints, replies[0])
        states_cold = masks.computed
        warm = [t for ids in replies for t in _steps_us(constraints, ids)]
        row = {
            "vocab": name,
            "V": size,
            "vocab_read_s": vocab_s,
            "cold_first_reply": _summary(cold),
            "states_built_first_reply": states_cold,
            "warm_all_replies": _summary(warm),
            "states_built_total": masks.computed,
            "masked_argmax_cpu_kept_us": _masked_argmax_us(size, args.rows, "cpu", False),
            "masked_argmax_cpu_overruled_us": _masked_argmax_us(size, args.rows, "cpu", True),
        }
        if torch.cuda.is_available():
            row["masked_argmax_cuda_us"] = _masked_argmax_us(size, args.rows, "cuda", True)
        results.append(row)
    header = (f"{'vocab':16} {'read s':>7} {'cold mean':>10} {'cold max':>9} {'states':>6} "
              f"{'warm mean':>10} {'warm p99':>9} {'cpu kept':>9} {'cpu overr.':>10} "
              f"{'gpu':>7}")  # fmt: skip
    print(f"host cost of the JSON mask per step (µs); masked argmax: {args.rows} constrained "
          "rows (mask keeps / overrules the argmax)")  # fmt: skip
    print(header)
    for r in results:
        gpu = r.get("masked_argmax_cuda_us")
        print(
            f"{r['vocab']:16} {r['vocab_read_s']:7.2f} {r['cold_first_reply']['mean_us']:10.0f} "
            f"{r['cold_first_reply']['max_us']:9.0f} {r['states_built_first_reply']:6d} "
            f"{r['warm_all_replies']['mean_us']:10.1f} {r['warm_all_replies']['p99_us']:9.1f} "
            f"{r['masked_argmax_cpu_kept_us']:9.0f} {r['masked_argmax_cpu_overruled_us']:10.0f} "
            f"{'-' if gpu is None else f'{gpu:7.0f}':>7}"
        )
    engine = _engine_steps(args.batch, args.steps) if args.engine else None
    if engine is not None:
        free, one = (f"{engine[k]['mean_step_ms'] or float('nan'):.2f}" for k in
                     ("free", "one_constrained"))  # fmt: skip
        print(f"engine on {engine['device']}, batch {args.batch}, greedy: steady step "
              f"{free} ms free, {one} ms with one constrained job "
              f"({engine['free']['steady_steps']} / {engine['one_constrained']['steady_steps']} "
              "steps)")  # fmt: skip
        print(f"constrained reply: {engine['constrained_reply']!r}")
    doc = {
        "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
        "reply_tokens": [len(r) for r in replies],
        "results": results,
        "engine": engine,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
