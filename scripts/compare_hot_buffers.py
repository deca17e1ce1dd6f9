"""Two engines with the run's settings, decoded side by side step by step: where do their
logits, slots, pool records and page metadata first differ? (docs/performance.md, "An
fp8 hot buffer": the divergence of ``hot_buffer_dtype=fp8`` in ``hisparse run``.)

CUDA only. Both engines take the ``h200`` preset's decode settings with ``kv_host_dtype:
fp8``, extend to ``--max-context``, prefill the same corpus documents and decode greedily;
after each step the logits, hits and misses are compared. At the first difference every
layer whose slot placement, slot values (fp8 slots dequantised), pool records (bytes),
pool exponents or page metadata differ is printed, with the first differing row of one
slot. ``--pair`` picks the engines: ``fp8-bf16`` (hot buffers fp8 and bf16) or
``bf16-bf16`` (two identical engines: the control). ``--attention`` first checks fp8-slot
sparse attention against attention over the dequantised slots at run-like sizes.

Usage::

    python scripts/compare_hot_buffers.py --model smol.gguf --corpus corpus \
        --pair fp8-bf16 [--no-overlap] [--no-write-stream] [--no-fused-rope] [--attention]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig, SamplingParams  # noqa: E402
from engine.events import Job  # noqa: E402
from engine.load import load_engine  # noqa: E402
from kernels.fp8_kv import fp8_dequantize_ref, fp8_quantize_ref  # noqa: E402

RUN_SETTINGS = dict(
    device="cuda", dtype="bfloat16", kv_dtype="bfloat16", weight_format="int4",
    attention="sparse", hierarchical=True, kv_host_dtype="fp8", indexer="quest",
    group_combine="normmax", page_size=16, top_k=2048, device_buffer=4096, sink_tokens=64,
    local_window=128, decode_overlap=True, max_batch=16, prefill_chunk=4096, host_pool_gb=8,
    context_policy="extend", int4_triton_min_rows=8,
)  # fmt: skip
DOCS = ("howto-sorting.txt", "howto-logging.txt", "library-re.txt")


def check_attention() -> None:
    """fp8 slots against the same records dequantised by the gather kernel, through the
    sparse attention kernel: 32 jobs, 3 KV heads, 132 selected pages of 16 tokens."""
    from kernels.bitmask import pack_bits
    from kernels.gather import gather_fp8
    from kernels.sparse_attention import sparse_decode_attention

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, s, p, k = 32, 9, 3, 64, 16, 400, 132
    n = b * hkv * k + 7
    x = torch.randn(n, 2, s, d, generator=g)
    x = x * torch.exp2(torch.randint(-6, 6, (n, 2, s, 1), generator=g).float())
    q8, e = (t.cuda() for t in fp8_quantize_ref(x))
    plain = torch.empty(n, 2, s, d, dtype=torch.bfloat16, device="cuda")
    idx = torch.arange(n, dtype=torch.int32, device="cuda")
    gather_fp8(q8.view(n, 1, 2, s, d), plain, idx.view(1, n), idx.view(1, 1, n), idx.view(1, 1, n),
               e.view(n, 1, 2, s))  # fmt: skip
    mask = torch.zeros(b, hkv, p, dtype=torch.bool)
    slot_list = torch.full((b, hkv, k), -1, dtype=torch.int32)
    perm = torch.randperm(n, generator=g)
    for i in range(b * hkv):
        pages = torch.randperm(p, generator=g)[: k - 4]
        mask.view(-1, p)[i, pages] = True
        slot_list.view(-1, k)[i, : k - 4] = perm[i * k : i * k + k - 4].int()
    args = (pack_bits(mask).cuda(), slot_list.cuda(), torch.full((b,), p * s - 5, dtype=torch.int32).cuda(), 0.125)
    q = torch.randn(b, hq, d, generator=g).bfloat16().cuda()
    for split in (None, 1, 4):
        a = sparse_decode_attention(q, plain, *args, pages_per_split=split)
        f = sparse_decode_attention(q, q8, *args, slot_scale=e, kv_dtype=torch.bfloat16, pages_per_split=split)
        print(f"attention, split {split}: {int((a != f).sum())} of {a.numel()} outputs differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--corpus", required=True, help="folder with the corpus documents")
    ap.add_argument("--pair", choices=("fp8-bf16", "bf16-bf16"), default="fp8-bf16")
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--no-overlap", action="store_true", help="decode_overlap off")
    ap.add_argument("--no-write-stream", action="store_true", help="decode_write_stream off")
    ap.add_argument("--no-graphs", action="store_true", help="cuda_graph off")
    ap.add_argument("--no-fused-rope", action="store_true", help="RoPE and the append apart")
    ap.add_argument("--attention", action="store_true", help="check the attention kernel first")
    ap.add_argument("--device", default="cuda", help="cuda (the finding's); cpu to try the script")
    args = ap.parse_args()
    if args.attention:
        check_attention()
    extra = {"max_context": args.max_context, "device": args.device}
    if args.device == "cpu":  # the CPU has no bf16 int4 kernel path to match; float32 KV
        extra |= {"dtype": "float32", "kv_dtype": "float32", "weight_format": "float",
                  "decode_overlap": False}  # fmt: skip
    if args.no_overlap:
        extra["decode_overlap"] = False
    if args.no_write_stream:
        extra["decode_write_stream"] = False
    if args.no_graphs:
        extra["cuda_graph"] = False
    hots = args.pair.split("-")
    engines = [load_engine(EngineConfig(**{**RUN_SETTINGS, **extra, "hot_buffer_dtype": h}), args.model)
               for h in hots]  # fmt: skip
    reqs = []
    for n, eng in enumerate(engines):
        eng.keep_logits = True
        if args.no_fused_rope:
            eng.fused_rope = False
        mine = []
        for i, doc in enumerate(DOCS):
            text = (Path(args.corpus) / doc).read_text(encoding="utf-8")
            ids = eng.tokenizer.encode_chat([{"role": "user", "content": "Summarize this document:\n\n" + text}])
            r = eng.open_request(Job(f"e{n}d{i}", tuple(ids), SamplingParams(max_tokens=args.steps + 50)))
            eng.prefill(r)
            mine.append(r)
        reqs.append(mine)
    same = all(torch.equal(a.logits, b.logits) for a, b in zip(*reqs, strict=True))
    print(f"{args.pair}: prompts {[len(r.job.prompt_ids) for r in reqs[0]]}, prefill logits equal {same}")
    for step in range(args.steps):
        tokens = [eng.decode_step(rs) for eng, rs in zip(engines, reqs, strict=True)]
        same = all(torch.equal(a.logits, b.logits) for a, b in zip(*reqs, strict=True))
        traffic = [(int(e.attn.hits.sum()), int(e.attn.misses.sum())) for e in engines]
        if not same or traffic[0] != traffic[1]:
            print(f"step {step}: logits equal {same}, hits/misses {traffic}, tokens {tokens}")
            report(*(e.cache for e in engines))
            return
        for rs, ts in zip(reqs, tokens, strict=True):
            for r, t in zip(rs, ts, strict=True):
                r.generated.append(t)
    print(f"{args.steps} steps: logits, hits and misses equal at every step")


def report(ca, cb) -> None:
    """Print each layer where the two caches' state differs."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()

    def values(c, layer, held):
        if c.hot_fp8:
            return fp8_dequantize_ref(c.slots[layer][held], c.slot_scale[layer][held], c.dtype)
        return c.slots[layer][held]

    for layer in range(ca.num_layers):
        placed = torch.equal(ca.slot_page[layer], cb.slot_page[layer])
        held = (ca.slot_page[layer] >= 0) & (cb.slot_page[layer] >= 0)
        va, vb = values(ca, layer, held), values(cb, layer, held)
        bad = (va.nan_to_num() != vb.nan_to_num()).flatten(2).any(-1)  # [slots, K|V]
        pool = (ca.pool[layer].view(torch.uint8) != cb.pool[layer].view(torch.uint8)).flatten(3).any(-1)
        meta = (ca.meta[layer] != cb.meta[layer]).flatten(2).any(-1)
        if placed and not bad.any() and not pool.any() and not meta.any():
            continue
        print(f"  layer {layer}: slot placement equal {placed}; slots differing {int(bad.sum())}; "
              f"pool records differing {int(pool.sum())} {pool.nonzero()[:3].tolist()}; "
              f"metadata rows differing {int(meta.sum())}")  # fmt: skip
        if placed and bad.any():
            i, kv = bad.nonzero()[0].tolist()
            rows = (va[i, kv].nan_to_num() != vb[i, kv].nan_to_num()).any(-1).nonzero().squeeze(1)
            r = int(rows[0])
            print(f"    slot {int(held.nonzero()[i])} K|V {kv} row {r}: {va[i, kv, r, :4].tolist()} "
                  f"against {vb[i, kv, r, :4].tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
