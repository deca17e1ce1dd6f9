"""Prefill time of one long prompt with the prefill copy stream on vs off (issue 4, item 8).

Usage (on a GPU machine)::

    python scripts/gpu_prefill_copy.py --out prefill_copy.json
    python scripts/gpu_prefill_copy.py --model SmolLM2-135M-Instruct.Q4_1.gguf --tokens 8000
    python scripts/gpu_prefill_copy.py --device cpu --model synthetic:tiny --tokens 2000  # dry run

The model defaults to synthetic (random 4-bit) Llama-3.1-8B weights drawn on the device, so
no model file or tokenizer is needed; the prompt is ``--tokens`` random token ids. Every
engine is hierarchical (K/V in a pinned host pool on CUDA), bf16, one request, and runs
``Engine.prefill`` of the whole prompt. Modes, interleaved over ``--repeats`` rounds after
one warm-up prefill each:

* ``blocking`` — ``prefill_copy_stream=False``: one blocking copy of each layer's records
  into the host pool after the layer's last chunk (the previous behaviour);
* ``copy_stream`` — ``prefill_copy_stream=True``: each chunk's records staged and copied on
  the copy stream, overlapping the next chunk's and layer's compute;
* ``no_write`` — ``copy_stream`` with the record copies skipped (metadata only; the pool is
  NOT written, output invalid): the floor the overlap can approach.

Reported per mode: median and all prefill wall times (CUDA-synchronised), prompt tokens/s;
once: host pool bytes written by one prefill, the time that takes at ``--link-gbps``,
whether ``copy_stream`` left the same pool and metadata bytes as ``blocking``
(``bit_identical``), and the pinned bytes torch's caching host allocator holds against the
pool size (it rounds each pinned block up to a power of two).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig, SamplingParams
from engine.events import Job
from engine.kv.cache import KVCache
from engine.serve.engine import Engine

MODES = ("blocking", "copy_stream", "no_write")


def load_model(name: str, device: torch.device, dtype: torch.dtype, cfg: EngineConfig):
    """``(model, context_limit)``: synthetic weights for ``synthetic:NAME`` (no tokenizer
    needed), else a GGUF file or model folder through :func:`engine.load.load_weights`."""
    from engine.load import context_limit_and_rope, load_weights, pick_weight_format
    from engine.model.llama import LlamaModel

    if name.startswith("synthetic:"):
        from engine.weights.synthetic import synthetic_shape, synthetic_weights

        weights = synthetic_weights(synthetic_shape(name), device=device)
    else:
        weights = load_weights(name)[0]
    limit, rope = context_limit_and_rope(weights.config, cfg)
    fmt = pick_weight_format(cfg, device)
    return LlamaModel(weights, device, dtype, fmt, rope), limit


def make_engine(model, cfg: EngineConfig, limit: int, tokens: int) -> Engine:
    """An engine over ``model`` whose host pool holds exactly one ``tokens``-token request."""
    from kernels.dispatch import get_ops

    max_pages = -(-limit // cfg.page_size)
    pages = -(-(tokens + 1) // cfg.page_size)
    cache = KVCache(model.config, cfg, model.device, max_pages, num_pool_pages=pages)
    return Engine(model, None, cfg, get_ops(model.device, cfg.use_triton), limit, cache=cache)


def skip_record_copies(cache: KVCache) -> None:
    """``no_write``: chunked writes set the metadata but copy no records."""

    def write(seq_id, layer, k, v, start):
        cache._write_meta(layer, cache._prefill_pages(seq_id, k, start), k)

    cache.write_prefill_chunk = write


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_once(eng: Engine, ids: tuple[int, ...], keep: bool = False):
    """Wall seconds of one whole-prompt prefill; with ``keep`` also the request's pool
    pages and metadata per layer (copied out after the copies have landed)."""
    dev = eng.model.device
    req = eng.open_request(Job("p", ids, SamplingParams(max_tokens=1)))
    sync(dev)
    t0 = time.perf_counter()
    eng.prefill(req)
    sync(dev)
    took = time.perf_counter() - t0
    kv = None
    if keep:
        c = eng.cache
        c.synchronize()
        idx = torch.tensor(c.seqs[req.seq_id].pages[: c.pages_for(len(ids))])
        kv = [(p[idx].cpu(), m[idx.to(m.device)].cpu()) for p, m in zip(c.pool, c.meta, strict=True)]
    eng.close_request(req)
    return took, kv


def host_pinned_bytes() -> int | None:
    """Bytes of pinned blocks torch's caching host allocator holds (None where unknown)."""
    if not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except (AttributeError, RuntimeError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:llama3.1-8b")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill_chunk (tokens)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--link-gbps", type=float, default=55.2, help="host link, for reference")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--out", type=Path, default=Path("prefill_copy.json"))
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    base = EngineConfig(
        device=args.device,
        dtype=dtype_name,
        kv_dtype=dtype_name,
        attention="sparse",
        hierarchical=True,
        page_size=args.page_size,
        prefill_chunk=args.chunk,
        max_batch=1,
    )
    base.validate()
    model, limit = load_model(args.model, device, getattr(torch, dtype_name), base)
    if args.tokens + 1 > limit:
        raise SystemExit(f"--tokens {args.tokens} exceeds the model's context of {limit}")
    gen = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(0, model.config.vocab_size, (args.tokens,), generator=gen).tolist())

    pinned_before = host_pinned_bytes()
    engines = {
        "blocking": make_engine(model, base.replace(prefill_copy_stream=False), limit, args.tokens),
        "copy_stream": make_engine(model, base, limit, args.tokens),
        "no_write": make_engine(model, base, limit, args.tokens),
    }
    skip_record_copies(engines["no_write"].cache)
    pinned_after = host_pinned_bytes()
    pool_bytes = sum(e.cache.pool_bytes_total for e in engines.values())

    kept = {}
    for mode, eng in engines.items():  # warm-up; keeps the bytes to compare
        _, kept[mode] = prefill_once(eng, ids, keep=mode != "no_write")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            times[mode].append(prefill_once(engines[mode], ids)[0])

    same = all(
        torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
        and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
        for a, b in zip(kept["copy_stream"], kept["blocking"], strict=True)
    )
    cache = engines["copy_stream"].cache
    written = cache.pages_for(args.tokens) * cache.page_bytes  # every layer's records
    rows = {}
    for mode in MODES:
        med = statistics.median(times[mode])
        rows[mode] = {"median_s": med, "tok_s": args.tokens / med, "runs_s": times[mode]}
        print(f"{mode:12s} prefill {med * 1e3:9.1f} ms  {args.tokens / med:10.0f} tok/s", flush=True)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "num_layers": model.config.num_layers,
        "prompt_tokens": args.tokens,
        "prefill_chunk": args.chunk,
        "page_size": args.page_size,
        "dtype": dtype_name,
        "copy_stream_active": cache.copy_stream is not None,
        "staging_bytes": cache.staging_bytes,
        "host_bytes_written_per_prefill": written,
        "host_copy_ms_at_link": written / (args.link_gbps * 1e9) * 1e3,
        "link_gbps_assumed": args.link_gbps,
        "bit_identical": same,
        "modes": rows,
        "saved_ms_copy_stream_vs_blocking": (
            rows["blocking"]["median_s"] - rows["copy_stream"]["median_s"]
        )
        * 1e3,
        "overhead_ms_copy_stream_vs_no_write": (
            rows["copy_stream"]["median_s"] - rows["no_write"]["median_s"]
        )
        * 1e3,
        "pinned_pool_bytes_requested": pool_bytes,
        "pinned_host_allocator_bytes": (
            None if pinned_before is None else pinned_after - pinned_before
        ),
    }
    print(
        f"bit_identical={same}; copy stream saves {report['saved_ms_copy_stream_vs_blocking']:.1f}"
        f" ms, {report['overhead_ms_copy_stream_vs_no_write']:.1f} ms above no_write; host "
        f"bytes/prefill {written / 2**20:.0f} MiB ({report['host_copy_ms_at_link']:.1f} ms at "
        f"{args.link_gbps} GB/s); pinned {report['pinned_host_allocator_bytes']} B for a "
        f"{pool_bytes} B pool",
        flush=True,
    )
    for eng in engines.values():
        eng.close()
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
