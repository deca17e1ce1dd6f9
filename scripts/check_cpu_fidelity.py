"""How close each CPU weight placement's decode is to llama.cpp's on the same GGUF
(issue 21): is the int4 kernel with bf16 products as faithful as float32 weights?

For each prompt (the chat-templated summarisation request of a corpus document, cut to
``--prompt-tokens``), llama.cpp (llama-cpp-python) decodes ``--steps`` tokens greedily and
keeps the logits after the prompt and after each token
(:func:`check_kquants.llamacpp_greedy`). Each hisparse variant (the ``cpu`` preset with
overrides, through ``load_engine`` / ``prefill`` / ``decode_step``: the real decode path) is
then teacher-forced with llama.cpp's tokens, so both score the same positions. Per variant,
against llama.cpp: top-1 agreement, mean KL(llama.cpp || hisparse) of the softmaxed logits
(nats), max / mean absolute logit difference, and the same against the first variant.

``--heads`` runs each variant with other LM heads too: ``engine`` (what the engine placed:
the tied embedding in float32, or an fp16 copy where the linears run bf16 products and fp16
measured faster, :func:`engine.weights.quant.pick_cpu_lm_head`), ``float32`` (the float32
head whatever the engine would pick), ``q8int4`` (its exact Q8_0 codes as two products of the
int4 kernel, :class:`engine.weights.quant.Q8Int4Linear`) and ``int8`` (re-quantised per row
to int8, torch's ``_weight_int8pack_mm`` with bf16 products), ``bf16`` and ``fp16`` (the
float weight, activations and logits rounded to that dtype,
:class:`engine.weights.quant.CastLinear`): measurements of those options against the head
the engine placed.

Usage::

    python scripts/check_cpu_fidelity.py [--docs a.txt b.txt] [--prompt-tokens 1500]
        [--steps 96] [--threads 2] [--variant weight_format=float ...]
        [--heads engine float32 q8int4 int8 bf16 fp16]
        [--out docs/bench/cpu_fidelity_2026-12-02.json]

Needs llama-cpp-python (``pip install -e .[bench]``). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from unittest.mock import patch

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu_llamacpp import build_prompt, parse_sets  # noqa: E402
from check_kquants import llamacpp_greedy  # noqa: E402

import engine.weights.quant as quant  # noqa: E402
from engine.config import SamplingParams  # noqa: E402
from engine.events import Job  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.measure.bench_kv import corpus_dir  # noqa: E402
from engine.presets import resolve_config  # noqa: E402
from engine.weights.embedded import default_model_path  # noqa: E402
from engine.weights.quant import CastLinear, Q8Int4Linear  # noqa: E402

DEFAULT_DOCS = ("tutorial-controlflow.txt", "howto-sorting.txt", "howto-logging.txt")


class Int8RowHead:
    """A float LM head ``[V, H]`` re-quantised per row to int8 (scale = row amax / 127),
    run by ``aten._weight_int8pack_mm`` with bf16 activations; float32 output."""

    def __init__(self, weight: torch.Tensor):
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        return y.view(*x.shape[:-1], -1).float()


def forced_logits(engine, ids: list[int], forced: list[int]) -> torch.Tensor:
    """float32 ``[len(forced) + 1, V]``: hisparse's logits after the prompt and after each
    of ``forced`` fed in turn (teacher forcing through ``decode_step``)."""
    engine.keep_logits = True
    req = engine.open_request(Job("fid", tuple(ids), SamplingParams(max_tokens=len(forced) + 1)))
    try:
        engine.prefill(req)
        rows = [req.logits.float().clone()]
        for tok in forced:
            req.generated[-1] = tok  # feed llama.cpp's token, not our argmax
            req.generated.append(engine.decode_step([req])[0])
            rows.append(req.logits.float().clone())
    finally:
        engine.close_request(req)
    return torch.stack(rows)


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Top-1 agreement, mean KL(ref || ours) in nats, max / mean |logit difference|."""
    logp_ref = torch.log_softmax(ref.double(), -1)
    logp = torch.log_softmax(ours.double(), -1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    diff = (ours - ref).abs()
    return {
        "positions": int(ref.shape[0]),
        "top1_agreement": round(float((ours.argmax(-1) == ref.argmax(-1)).float().mean()), 4),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "max_abs_logit_diff": round(float(diff.max()), 4),
        "mean_abs_logit_diff": round(float(diff.mean()), 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--docs", nargs="*", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=None,
        help="hisparse overrides key=value,... (repeatable; default float and int4)",
    )
    ap.add_argument(
        "--heads",
        nargs="+",
        choices=("engine", "float32", "q8int4", "int8", "bf16", "fp16"),
        default=["engine"],
    )
    ap.add_argument("--out", type=Path, default=Path("cpu_fidelity.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variants or ["weight_format=float", "weight_format=int4"]
    docs = (
        [Path(d) for d in args.docs]
        if args.docs
        else [
            corpus_dir() / n if (corpus_dir() / n).exists() else Path("examples") / n
            for n in DEFAULT_DOCS
        ]
    )
    engines = {}
    for v in variants:
        for head in args.heads:
            sets = {
                "num_threads": args.threads,
                "max_batch": 1,
                "host_pool_gb": 1.0,
                **parse_sets(v.split(",")),
            }
            if head == "engine":
                eng = load_engine(resolve_config("cpu", cli_overrides=sets))
            else:  # every other head starts from the float32 one (no fp16 choice at load)
                with patch.object(quant, "pick_cpu_lm_head", lambda h: (h, "")):
                    eng = load_engine(resolve_config("cpu", cli_overrides=sets))
            m = eng.model
            if head == "q8int4":
                m.lm_head = Q8Int4Linear.from_float(m.lm_head.weight)
                if m.lm_head is None:
                    raise SystemExit("--heads q8int4: the LM head does not hold Q8_0 values")
            elif head == "int8":
                m.lm_head = Int8RowHead(m.lm_head.weight)
            elif head in ("bf16", "fp16"):
                dt = torch.bfloat16 if head == "bf16" else torch.float16
                m.lm_head = CastLinear(m.lm_head.weight.float(), dt)
            name = v if head == "engine" else f"{v} +{head} head"
            engines[name] = eng
            print(f"{name}: {eng.weight_format} ({eng.weights_info})", flush=True)
    tokenizer = next(iter(engines.values())).tokenizer
    ours: dict[str, list[torch.Tensor]] = {name: [] for name in engines}
    refs, prompts = [], []
    for doc in docs:
        ids = build_prompt(tokenizer, doc, args.prompt_tokens)
        t0 = time.perf_counter()
        forced, ref = llamacpp_greedy(default_model_path(), ids, args.steps, args.threads)
        print(
            f"{doc.name}: {len(ids)} prompt tokens, llama.cpp {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        refs.append(torch.from_numpy(np.asarray(ref)).float())
        prompts.append({"doc": doc.name, "prompt_tokens": len(ids)})
        for name, eng in engines.items():
            ours[name].append(forced_logits(eng, ids, forced))
    ref_all = torch.cat(refs)
    first = next(iter(engines))
    rows = {}
    for name in engines:
        got = torch.cat(ours[name])
        rows[name] = {
            "label": f"{engines[name].weight_format}: {engines[name].weights_info}",
            "vs_llamacpp": compare(got, ref_all),
            f"vs_{first}": compare(got, torch.cat(ours[first])),
            "per_prompt_vs_llamacpp": [
                compare(o, r) for o, r in zip(ours[name], refs, strict=True)
            ],
        }
    print(f"\n{ref_all.shape[0]} positions ({len(docs)} prompts x {args.steps + 1})")
    print(
        f"{'variant':40s} {'top-1 vs llama.cpp':>18s} {'KL vs llama.cpp':>16s} "
        f"{'top-1 vs ' + first:>26s} {'KL vs ' + first:>22s}"
    )
    for name, r in rows.items():
        a, b = r["vs_llamacpp"], r[f"vs_{first}"]
        per = " ".join(f"{x['kl_mean']:.2e}" for x in r["per_prompt_vs_llamacpp"])
        print(
            f"{name:40s} {a['top1_agreement']:18.4f} {a['kl_mean']:16.2e} "
            f"{b['top1_agreement']:26.4f} {b['kl_mean']:22.2e}   KL per prompt: {per}"
        )
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "steps": args.steps,
        "prompts": prompts,
        "variants": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
