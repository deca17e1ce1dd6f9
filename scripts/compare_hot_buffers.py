"""Two engines with the run's settings, decoded side by side step by step: where do their
logits, slots, pool records and page metadata first differ? (docs/performance.md, "An
fp8 hot buffer": the divergence of ``hot_buffer_dtype=fp8`` in ``hisparse run``.)

CUDA only. Both engines take the ``h200`` preset's decode settings with ``kv_host_dtype:
fp8``, extend to ``--max-context``, prefill the same corpus documents and decode greedily;
after each step the logits, hits and misses are compared. At the first difference every
layer whose slot placement, slot values (fp8 slots dequantised), pool records (bytes),
pool exponents or page metadata differ is printed, with the first differing row of one
slot. ``--pair`` picks the engines: ``fp8-bf16`` (hot buffers fp8 and bf16) or
``bf16-bf16`` (two identical engines: the control). ``--trace`` decodes eagerly and
names the first attention call whose inputs or output differ; where only the output
does, it redoes that call's fp8 slots against them dequantised, at several split widths,
and lists the MMA operand layouts (``kWidth``) of the compiled kernel variants.
``--attention`` first runs the same kernel comparison on random run-like cases.

Usage::

    python scripts/compare_hot_buffers.py --model smol.gguf --corpus corpus \
        --pair fp8-bf16 [--trace] [--no-overlap] [--no-write-stream] [--no-fused-rope] \
        [--attention]
"""

from __future__ import annotations

import argparse
import dataclasses
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


def check_attention(cases: int = 60) -> None:
    """fp8 slots against the same records dequantised to bf16, through the sparse attention
    kernel, on random run-like cases (1-3 jobs, 3 KV heads of 3 query heads, 124 selected
    16-token pages, split widths 1-8 and the default), then the MMA operand layouts
    (``kWidth``) of the compiled variants."""
    from kernels.bitmask import pack_bits
    from kernels.sparse_attention import _sparse_decode_split_kernel, sparse_decode_attention

    g = torch.Generator().manual_seed(1)
    hq, hkv, d, s, p, k_max, n = 9, 3, 64, 16, 1400, 128, 1200
    inputs = []
    for c in range(cases):
        b = 1 + c % 3
        x = torch.randn(n, 2, s, d, generator=g)
        x = x * torch.exp2(torch.randint(-3, 3, (n, 2, s, 1), generator=g).float())
        q8, e = (t.cuda() for t in fp8_quantize_ref(x))
        mask = torch.zeros(b, hkv, p, dtype=torch.bool)
        slot_list = torch.full((b, hkv, k_max), -1, dtype=torch.int32)
        for i in range(b * hkv):
            mask.view(-1, p)[i, torch.randperm(p, generator=g)[: k_max - 4]] = True
            slot_list.view(-1, k_max)[i, : k_max - 4] = torch.randperm(n, generator=g)[: k_max - 4].int()
        lens = torch.full((b,), p * s - 5, dtype=torch.int32).cuda()
        q = (torch.randn(b, hq, d, generator=g) * 3).bfloat16().cuda()
        inputs.append((q, q8, e, fp8_dequantize_ref(q8, e, torch.bfloat16), pack_bits(mask).cuda(), slot_list.cuda(), lens))
    total = sum(i[0].numel() for i in inputs)
    for split in (1, 2, 4, 8, None):
        bad = 0
        for q, q8, e, plain, sel, sl, lens in inputs:
            a = sparse_decode_attention(q, plain, sel, sl, lens, 0.125, pages_per_split=split)
            f = sparse_decode_attention(q, q8, sel, sl, lens, 0.125, slot_scale=e, kv_dtype=torch.bfloat16,
                                        pages_per_split=split)  # fmt: skip
            bad += int((a != f).sum())
        print(f"attention, pages_per_split {split}: {bad} of {total} outputs differ")
    mma_kinds(_sparse_decode_split_kernel)


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
    ap.add_argument("--trace", action="store_true",
                    help="eager steps (no graphs); at the first difference, the first layer whose "
                    "attention inputs or output differ")
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
    if args.no_graphs or args.trace:
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
    traces = [trace(e) for e in engines] if args.trace else None
    same = all(torch.equal(a.logits, b.logits) for a, b in zip(*reqs, strict=True))
    print(f"{args.pair}: prompts {[len(r.job.prompt_ids) for r in reqs[0]]}, prefill logits equal {same}")
    for step in range(args.steps):
        for t in traces or ():
            t.clear()
        tokens = [eng.decode_step(rs) for eng, rs in zip(engines, reqs, strict=True)]
        same = all(torch.equal(a.logits, b.logits) for a, b in zip(*reqs, strict=True))
        traffic = [(int(e.attn.hits.sum()), int(e.attn.misses.sum())) for e in engines]
        if not same or traffic[0] != traffic[1]:
            print(f"step {step}: logits equal {same}, hits/misses {traffic}, tokens {tokens}")
            if traces:
                first_layer(*traces)
            report(*(e.cache for e in engines))
            return
        for rs, ts in zip(reqs, tokens, strict=True):
            for r, t in zip(rs, ts, strict=True):
                r.generated.append(t)
    print(f"{args.steps} steps: logits, hits and misses equal at every step")


def trace(eng) -> list:
    """Record ``(layer, row0, q, k, v, out, attention call)`` of every attention call of
    ``eng`` (eager): the inputs before RoPE, the output, and the sparse attention kernel's
    arguments (cloned; ``None`` where the layer made no such call)."""
    rec, calls = [], []
    run, ops = eng.attn.run, eng.attn.ops

    def attention(*args, **kw):
        calls.append(([a.clone() if torch.is_tensor(a) else a for a in args],
                      {n: a.clone() if torch.is_tensor(a) else a for n, a in kw.items()}))  # fmt: skip
        return ops.sparse_decode_attention(*args, **kw)

    def traced(plan, layer, q, k, v, rope=None):
        calls.clear()
        a = run(plan, layer, q, k, v, rope)
        call = calls[-1] if calls else None
        rec.append((layer, plan.row0, q.clone(), k.clone(), v.clone(), a.clone(), call))
        return a

    eng.attn.ops = dataclasses.replace(ops, sparse_decode_attention=attention)
    eng.attn.run = traced
    return rec


def first_layer(ta, tb) -> None:
    """Print the first attention call whose inputs (q, k, v before RoPE) or output differ;
    where the inputs are equal, redo both sides' attention calls with each other's
    records to tell a kernel difference from a state difference."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for a, b in zip(sorted(ta, key=lambda r: r[:2]), sorted(tb, key=lambda r: r[:2]), strict=True):
        ins = [torch.equal(x, y) for x, y in zip(a[2:5], b[2:5], strict=True)]
        out = torch.equal(a[5], b[5])
        if all(ins) and out:
            continue
        d = (a[5].float() - b[5].float()).abs()
        rows = d.flatten(1).amax(1).nonzero().squeeze(1).tolist()
        print(f"  first difference: layer {a[0]} row0 {a[1]}: q, k, v equal {ins}; attention "
              f"output equal {out} (max |diff| {float(d.max()):.3g}, batch rows {rows[:8]})")  # fmt: skip
        if a[6] is not None and b[6] is not None:
            redo(a[6], b[6])
        return
    print("  every attention call has equal inputs and outputs")


def redo(ca, cb) -> None:
    """Two recorded sparse attention calls (args, kwargs): compare their arguments, then
    run each one's records through the kernel in the other's dtype."""
    from kernels.sparse_attention import sparse_decode_attention

    (qa, sa, sela, sla, lena, *resta), kwa = ca
    (qb, sb, selb, slb, lenb, *restb), kwb = cb
    print(f"    arguments equal: q {torch.equal(qa, qb)}, selection {torch.equal(sela, selb)}, "
          f"slot_list {torch.equal(sla, slb)}, seq_lens {torch.equal(lena, lenb)}, "
          f"rest {resta == restb}; kv {sa.dtype} / {sb.dtype}; kwargs {sorted(kwa)} / {sorted(kwb)}")  # fmt: skip
    fp8, plain, kw8 = (sa, sb, kwa) if "slot_scale" in kwa else (sb, sa, kwb)
    deq = fp8_dequantize_ref(fp8, kw8["slot_scale"], plain.dtype)
    used = sla[sla >= 0].long().unique()
    same = torch.equal(deq[used].nan_to_num(), plain[used].nan_to_num())
    print(f"    the {used.numel()} slots read: fp8 dequantised == bf16 slots {same}")
    for name, (q, sel, sl, ln, rest) in (("fp8 side", (qa, sela, sla, lena, resta)),):
        o8 = sparse_decode_attention(q, fp8, sel, sl, ln, *rest, **kw8)
        ob = sparse_decode_attention(q, deq, sel, sl, ln, *rest)
        d = (o8.float() - ob.float()).abs()
        print(f"    {name}'s call, its fp8 slots against them dequantised: "
              f"{int((o8 != ob).sum())} of {o8.numel()} outputs differ (max {float(d.max()):.3g}); "
              f"shapes q {tuple(q.shape)} slot_list {tuple(sl.shape)}")  # fmt: skip
        for split in (1, 2, 4, 8, 16, 64):
            o8 = sparse_decode_attention(q, fp8, sel, sl, ln, *rest, **kw8, pages_per_split=split)
            ob = sparse_decode_attention(q, deq, sel, sl, ln, *rest, pages_per_split=split)
            print(f"      pages_per_split {split}: {int((o8 != ob).sum())} differ")
    mma_kinds()


def mma_kinds(kern=None) -> None:
    """Each compiled variant of the split kernel: fp8 slots or not, and the ``kWidth`` of
    its MMA operand layouts (the order in which the MMA sums along K depends on it)."""
    import re

    if kern is None:
        from kernels.sparse_attention import _sparse_decode_split_kernel as kern
    try:
        for dev in kern.device_caches:
            for ck in kern.device_caches[dev][0].values():
                ttgir = ck.asm.get("ttgir", "")
                widths = sorted(set(re.findall(r"kWidth ?= ?(\d+)", ttgir)))
                ptx = ck.asm.get("ptx", "")
                print(f"  compiled variant, fp8 slots {'f8E4M3' in ttgir}: kWidth {widths}, "
                      f"wgmma {ptx.count('wgmma.mma_async')}, mma.sync {ptx.count('mma.sync')}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a diagnostic: Triton's cache layout varies
        print(f"  (no compiled variants to list: {type(exc).__name__}: {exc})")


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
