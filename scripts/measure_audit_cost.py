"""Cost of the per-job fidelity audit (``--audit N``, :mod:`engine.decode.audit`): one job
decoded with and without it, alternately, in one process, on the same engine settings.

Prompt: the chat-templated summarisation request of a corpus document (default
``howto-sorting.txt``, ~3.2K tokens on the embedded SmolLM2). For each run: the job's wall
time (admission to finish, prefill included), its decode time, the seconds the audit took
(the engine's own count) and whether the generated tokens equal the unaudited run's (they
must: the audit only reads the KV).

Usage::

    python scripts/measure_audit_cost.py [--doc FILE] [--new-tokens 128] [--audit 8]
        [--top-k 512] [--reps 2] [--device cpu|cuda:0] [--out audit_cost.json]

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path

import torch

from engine import events as ev
from engine.config import EngineConfig, SamplingParams
from engine.load import load_engine

CORPUS = Path(
    os.environ.get("HISPARSE_CORPUS", Path(__file__).resolve().parents[2] / "shared" / "corpus")
)


def one_run(engine, ids: list[int], new_tokens: int) -> dict:
    """Run one job through ``engine.run``; its wall, decode and audit seconds."""
    job = ev.Job("audit-cost", tuple(ids), SamplingParams(max_tokens=new_tokens))
    t_admit = t_first = t_end = 0.0
    result = None
    for event in engine.run([job]):
        if isinstance(event, ev.JobAdmitted):
            t_admit = event.t
        elif isinstance(event, ev.FirstToken):
            t_first = event.t
        elif isinstance(event, ev.JobFinished):
            t_end, result = event.t, event.result
        elif isinstance(event, ev.JobFailed):
            raise SystemExit(f"job failed: {event.error}")
    assert result is not None
    audit = result.audit
    return {
        "wall_s": t_end - t_admit,
        "decode_s": t_end - t_first,
        "audit_s": audit.seconds if audit else 0.0,
        "audit": None if audit is None else {
            "steps": audit.steps,
            "top1_agreement": audit.top1_agreement,
            "kl_mean": audit.kl_mean,
            "kl_max": audit.kl_max,
            "mass_kept_mean": audit.mass_kept_mean,
        },
        "tokens": list(result.token_ids),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", type=Path, default=CORPUS / "howto-sorting.txt")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--audit", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("audit_cost.json"))
    args = ap.parse_args()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    base = EngineConfig(
        device=args.device, dtype=dtype, kv_dtype=dtype, host_pool_gb=1.0, max_batch=1,
        top_k=args.top_k,
    )
    engines = {0: load_engine(base), args.audit: load_engine(base.replace(audit_steps=args.audit))}
    tok = engines[0].tokenizer
    text = args.doc.read_text(encoding="utf-8")
    ids = tok.encode_chat([{"role": "user", "content": "Summarize this document:\n\n" + text}])
    rows = []
    for rep in range(args.reps):
        for n, engine in engines.items():
            row = {"rep": rep, "audit_steps": n, **one_run(engine, ids, args.new_tokens)}
            rows.append(row)
            print(f"rep {rep} audit {n}: wall {row['wall_s']:.1f} s, decode {row['decode_s']:.1f} s, "
                  f"audit {row['audit_s']:.2f} s", flush=True)
    plain = [r for r in rows if r["audit_steps"] == 0]
    audited = [r for r in rows if r["audit_steps"]]
    same = all(r["tokens"] == plain[0]["tokens"] for r in rows)

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    summary = {
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "audit_steps": args.audit,
        "top_k": args.top_k,
        "wall_s_plain": mean(plain, "wall_s"),
        "wall_s_audited": mean(audited, "wall_s"),
        "audit_s": mean(audited, "audit_s"),
        "audit_share_of_wall": mean(audited, "audit_s") / mean(audited, "wall_s"),
        "audit_s_per_step": mean(audited, "audit_s") / max(args.audit, 1),
        "decode_s_per_step_plain": mean(plain, "decode_s") / max(args.new_tokens - 1, 1),
        "tokens_identical": same,
        "audit": audited[0]["audit"],
    }
    print()
    print("| prompt | new | N | wall plain s | wall audited s | audit s | audit share | "
          "audit s/step | decode s/step | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    s = summary
    print(f"| {s['prompt_tokens']} | {s['new_tokens']} | {s['audit_steps']} | "
          f"{s['wall_s_plain']:.1f} | {s['wall_s_audited']:.1f} | {s['audit_s']:.2f} | "
          f"{100 * s['audit_share_of_wall']:.1f}% | {s['audit_s_per_step']:.3f} | "
          f"{s['decode_s_per_step_plain']:.3f} | {s['tokens_identical']} |")
    print("audit figures:", s["audit"])
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "doc": str(args.doc),
    }
    for r in rows:
        r.pop("tokens")
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
