"""The real model on a CUDA GPU: exactness of the hierarchical path with the Triton kernels,
Triton vs reference kernels, and decode tokens/s dense vs sparse vs hierarchical.

Usage (on a GPU machine)::

    python scripts/gpu_engine_check.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --doc examples/howto-sorting.txt --out gpu_engine.json

1. exactness: hierarchical (small hot buffer, forced misses) vs all-resident sparse, both on
   the Triton kernels, 64 greedy decode steps: logits compared bit for bit, tokens equal;
2. Triton vs PyTorch-reference kernels on the same GPU: max |logit diff| and token agreement;
3. decode tokens/s at batch 1, 8 and 32 (copies of one prompt) for dense, sparse all-resident
   and hierarchical (top_k 2048 tokens, device_buffer 4096), bf16, int4 weights — the same
   requests decoded with CUDA graphs, then with eager launches (step time with and without).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.config import EngineConfig, SamplingParams
from engine.events import Job
from engine.load import load_engine

_BASE = {}
DEVICE = "cuda"
DTYPE = "bfloat16"
BATCHES = (1, 8, 32)


def make(model: str, **kw):
    """An engine with settings ``kw``; weights are loaded once and shared."""
    from engine.serve.engine import Engine
    from kernels.dispatch import get_ops

    cfg = EngineConfig(
        device=DEVICE, dtype=DTYPE, kv_dtype=DTYPE, host_pool_gb=8.0, max_batch=32, **kw
    )
    if model not in _BASE:
        _BASE[model] = load_engine(cfg, model)
        eng = _BASE[model]
    else:
        base = _BASE[model]
        eng = Engine(
            base.model, base.tokenizer, cfg, get_ops(DEVICE, cfg.use_triton), base.context_limit
        )
    eng.keep_logits = True
    return eng


def run_greedy(eng, ids, steps):
    req = eng.open_request(Job("x", tuple(ids), SamplingParams(max_tokens=steps + 1)))
    eng.prefill(req)
    logits = [req.logits.clone()]
    while len(req.generated) < steps:
        req.generated.append(eng.decode_step([req])[0])
        logits.append(req.logits.clone())
    eng.close_request(req)
    return req.generated, torch.stack(logits)


def exactness(model, ids, steps=64) -> dict:
    steps = steps if DEVICE != "cpu" else 8
    common = dict(attention="sparse", top_k=256, page_size=16, sink_tokens=16, local_window=32)
    res = make(model, hierarchical=False, **common)
    t_res, l_res = run_greedy(res, ids, steps)
    res.close()  # frees its KV pool now
    del res
    hier = make(model, hierarchical=True, device_buffer=320, **common)
    req = hier.open_request(Job("h", tuple(ids), SamplingParams(max_tokens=steps + 1)))
    hier.prefill(req)
    hits = misses = 0
    logits = [req.logits.clone()]
    while len(req.generated) < steps:
        req.generated.append(hier.decode_step([req])[0])
        logits.append(req.logits.clone())
        hits += int(hier.attn.hits.sum())
        misses += int(hier.attn.misses.sum())
    hier.cache.check_integrity()
    hier.close_request(req)
    hier.close()
    l_h = torch.stack(logits)
    ref = make(model, hierarchical=True, device_buffer=320, use_triton=False, **common)
    t_ref, l_ref = run_greedy(ref, ids, steps)
    ref.close()
    return {
        "steps": steps,
        "prompt_tokens": len(ids),
        "ops": hier.ops.name,
        "bit_identical_logits": bool(torch.equal(l_h, l_res)),
        "tokens_equal": req.generated == t_res,
        "hits": hits,
        "misses": misses,
        "triton_vs_reference_max_logit_diff": float((l_h - l_ref).abs().max()),
        "triton_vs_reference_token_agreement": sum(
            a == b for a, b in zip(t_ref, req.generated, strict=False)
        )
        / steps,
    }


def _sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def throughput(model, ids, batch, steps=32, **kw) -> dict:
    steps = steps if DEVICE != "cpu" else 2
    eng = make(model, **kw)
    reqs = [
        eng.open_request(Job(f"b{i}", tuple(ids), SamplingParams(max_tokens=2 * steps + 16)))
        for i in range(batch)
    ]
    t0 = time.perf_counter()
    for r in reqs:
        eng.prefill(r)
    _sync()
    prefill_s = time.perf_counter() - t0
    out = {"batch": batch, "prefill_tok_s": batch * len(ids) / prefill_s}
    # The same requests decode with CUDA graphs (when the engine can use them), then
    # with eager launches: step time with and without graphs on identical work.
    graphs = eng.graphs
    for label in ("graph", "eager"):
        if label == "eager":
            eng.graphs = None
        elif graphs is None:
            continue
        for _ in range(3):  # warm-up (and the graph capture)
            for r, t in zip(reqs, eng.decode_step(reqs), strict=False):
                r.generated.append(t)
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            for r, t in zip(reqs, eng.decode_step(reqs), strict=False):
                r.generated.append(t)
        _sync()
        dt = time.perf_counter() - t0
        out[f"decode_tok_s_{label}"] = batch * steps / dt
        out[f"step_ms_{label}"] = dt / steps * 1e3
    best = "graph" if graphs is not None else "eager"
    out["decode_tok_s"], out["step_ms"] = out[f"decode_tok_s_{best}"], out[f"step_ms_{best}"]
    out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE != "cpu" else 0.0
    for r in reqs:
        eng.close_request(r)
    eng.close()  # the pinned host pool goes back now, not at garbage collection
    del eng
    if DEVICE != "cpu":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--doc", type=Path, default=Path("examples/howto-sorting.txt"))
    ap.add_argument("--long-doc", type=Path, default=None, help="document for the throughput runs")
    ap.add_argument("--out", type=Path, default=Path("gpu_engine.json"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    args = ap.parse_args()
    global DEVICE, DTYPE, BATCHES
    if args.device != "cuda":
        DEVICE, DTYPE, BATCHES = args.device, "float32", (1, 2)
    base = make(args.model, attention="dense")  # loads the weights; its cache is not used
    tok = base.tokenizer
    base.close()
    ids = tok.encode_chat([{"role": "user", "content": "Summarize:\n\n" + args.doc.read_text()}])
    report = {
        "device": torch.cuda.get_device_name() if DEVICE != "cpu" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    report["exactness"] = exactness(args.model, ids)
    print(json.dumps(report["exactness"], indent=1), flush=True)
    long_text = (args.long_doc or args.doc).read_text()
    long_ids = tok.encode_chat([{"role": "user", "content": "Summarize:\n\n" + long_text}])[:7000]
    modes = {
        "dense": dict(attention="dense"),
        "sparse-resident": dict(attention="sparse", hierarchical=False, page_size=16),
        "hierarchical": dict(attention="sparse", hierarchical=True, page_size=16),
    }
    rows = []
    for name, kw in modes.items():
        for batch in BATCHES:
            r = throughput(args.model, long_ids, batch, **kw)
            r["mode"] = name
            rows.append(r)
            print(
                f"{name:16s} batch {batch:3d}: {r['decode_tok_s']:8.1f} tok/s "
                f"({r['step_ms']:.1f} ms/step; eager {r['step_ms_eager']:.1f} ms/step), "
                f"prefill {r['prefill_tok_s']:.0f} tok/s, "
                f"peak {r['peak_gpu_gib']:.2f} GiB",
                flush=True,
            )
    report["throughput"] = {"prompt_tokens": len(long_ids), "rows": rows}
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
