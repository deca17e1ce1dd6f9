"""CPU speed: prefill and decode tokens/s of hisparse against transformers' eager CPU path
on the same GGUF, in the same run.

Prompt: the chat-templated summarisation request of a corpus document (default
``tutorial-controlflow.txt``, ~10K tokens; SmolLM2's trained context is 8192, so our engine
runs with ``context_policy=extend``; speed, not quality, is measured). transformers loads the
GGUF dequantised to float32 (``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``) and
runs ``model(ids)`` for prefill and ``generate`` (greedy, KV cache) for decode.

Usage::

    python scripts/bench_cpu.py [--doc FILE] [--decode-tokens 64] [--threads 2] [--out bench_cpu.json]

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from engine.config import EngineConfig, SamplingParams
from engine.events import Job
from engine.load import load_engine
from engine.measure.bench_kv import corpus_dir
from engine.weights.embedded import default_model_path

CORPUS = corpus_dir()  # $HISPARSE_CORPUS, ../shared/corpus, else examples/


def prompt_ids(tokenizer, doc: Path) -> list[int]:
    text = doc.read_text(encoding="utf-8")
    return tokenizer.encode_chat(
        [{"role": "user", "content": "Summarize this document:\n\n" + text}]
    )


def bench_ours(ids: list[int], n_decode: int, **overrides) -> dict:
    cfg = EngineConfig(
        host_pool_gb=2.0, max_batch=1, context_policy="extend", max_context=16384, **overrides
    )
    engine = load_engine(cfg)
    req = engine.open_request(Job("bench", tuple(ids), SamplingParams(max_tokens=n_decode + 1)))
    t0 = time.perf_counter()
    engine.prefill(req)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_decode):
        req.generated.append(engine.decode_step([req])[0])
    decode_s = time.perf_counter() - t0
    engine.close_request(req)
    return {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": n_decode / decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
    }


def bench_transformers(ids: list[int], n_decode: int) -> dict:
    """Prefill with one forward that returns the KV cache, then greedy decode step by step
    on that cache (what ``generate`` does, without re-running the prefill)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(x, use_cache=True)
        prefill_s = time.perf_counter() - t0
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(n_decode):
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": n_decode / decode_s,
            "prefill_s": prefill_s, "decode_s": decode_s}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--doc", type=Path, default=CORPUS / "tutorial-controlflow.txt")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.text.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf(default_model_path(), reference="llama.cpp")
    ids = prompt_ids(tok, args.doc)
    runs = {
        "hisparse dense": lambda: bench_ours(ids, args.decode_tokens, attention="dense"),
        "hisparse sparse (hierarchical, top_k 2048)": lambda: bench_ours(ids, args.decode_tokens),
    }
    if not args.skip_transformers:
        runs["transformers eager (fp32)"] = lambda: bench_transformers(ids, args.decode_tokens)
    rows = {}
    for name, fn in runs.items():
        rows[name] = fn()
        print(f"{name}: {rows[name]}", flush=True)
    print(
        f"\n{args.doc.name}: {len(ids)} prompt tokens, {args.decode_tokens} decode tokens, "
        f"{args.threads} threads, torch {torch.__version__}"
    )
    print(f"{'engine':45s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for name, r in rows.items():
        print(f"{name:45s} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.2f}")
    report = {
        "doc": args.doc.name,
        "prompt_tokens": len(ids),
        "decode_tokens": args.decode_tokens,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "results": rows,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
