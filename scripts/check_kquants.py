"""The embedded model in each llama.cpp quantisation type: does hisparse load it, match
llama.cpp on it, and still summarise a document? (issue 17)

1. **Source.** The embedded SmolLM2-135M-Instruct Q4_1 GGUF
   (:func:`engine.weights.embedded.default_model_path`) is decoded tensor by tensor with
   ``gguf.quants.dequantize`` and written as an all-F32 GGUF with gguf-py's ``GGUFWriter``,
   every metadata key copied (tokenizer, chat template), ``general.file_type`` set to
   ``ALL_F32`` (0). F32 keeps the Q4_1 values exact.
2. **Quantise.** llama.cpp's own quantiser (llama-cpp-python ``llama_model_quantize`` with
   ``llama_model_quantize_default_params()``, no importance matrix) turns that file into
   each ``--types`` file. A type llama.cpp refuses without an imatrix is reported and
   skipped. llama.cpp picks each tensor's type itself (the ``_M`` mixes, and fallbacks for
   rows that are not whole 256-element super-blocks: SmolLM2's K = 576 rows fall back to
   Q5_0 / Q5_1 / Q8_0 / IQ4_NL); the tensor-type counts are in the JSON.
3. **Per file**:
   (a) hisparse loads it (``engine.load.load_weights``) and the model line the ``cpu`` preset
       prints (float placement) and the one int4 placement (the CUDA default) would print;
   (b) teacher-forced logits against llama.cpp on the same file: the chat-templated
       summarisation prompt of ``--doc`` (the messages ``hisparse run --task summarize``
       builds) goes to llama.cpp (``Llama.eval``), which then decodes ``--max-new-tokens``
       greedily, keeping the logits of every step; hisparse's model (dense float32 forward
       over prompt + llama.cpp's tokens, :class:`engine.model.llama.LlamaModel`) gives the
       logits at the same positions. Reported: top-1 agreement over those positions, max /
       mean absolute logit difference, and how many leading greedy tokens agree (hisparse's
       own greedy decode equals llama.cpp's up to the first position whose argmax differs).
       Control (``--no-control`` leaves it out): llama.cpp fed the same tokens on the
       file's weights decoded to F32 by gguf-py, i.e. the same weight values through its
       float kernels, which do not quantise activations as its K-quant / Q8_0 CPU dot
       products do (Q8_K / Q8_0 activations); it separates reading the blocks from that
       arithmetic;
   (c) ``hisparse run DOC --preset cpu --model FILE --max-new-tokens N`` (a subprocess, the
       real command: sparse hierarchical decode) and its summary text.

Usage::

    python scripts/check_kquants.py [--types Q4_K_M Q5_K_M ...] [--work-dir /tmp/kquants]
        [--doc examples/howto-sorting.txt] [--max-new-tokens 64] [--threads 2]
        [--out docs/bench/kquants_cpu_2026-12-02.json] [--skip-run]

Needs llama-cpp-python (``pip install -e .[bench]``) and gguf. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.load import context_limit_and_rope, load_weights
from engine.weights.embedded import default_model_path
from engine.weights.types import describe_placement

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "Q8_0", "IQ4_XS")
ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32 (llama.h)


# ----------------------------------------------------------------------------- files


def write_f32_copy(src: Path, dst: Path) -> Path:
    """``src`` GGUF with every tensor decoded to float32 (``gguf.quants.dequantize``) and
    every metadata key copied (``general.file_type`` set to ALL_F32)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():  # as gguf-py's gguf_new_metadata.py copies them
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        writer.add_tensor(t.name, np.ascontiguousarray(values.reshape(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def quantize(src: Path, dst: Path, type_name: str, threads: int) -> None:
    """llama.cpp's quantiser, ``LLAMA_FTYPE_MOSTLY_<type_name>``, default parameters.

    Raises
    ------
    RuntimeError
        llama.cpp returned non-zero (e.g. a type that needs an importance matrix).
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        dst.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({type_name}) returned {rc}")


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


# ----------------------------------------------------------------------------- (b) logits


def prompt_ids(tokenizer, doc: Path) -> list[int]:
    """The summarisation prompt ``hisparse run --task summarize`` builds for ``doc``."""
    from hisparse_cli.tasks import TaskSpec, build_messages

    messages = build_messages(TaskSpec(), doc.read_text(encoding="utf-8"), doc.stem, doc.name)
    return tokenizer.encode_chat(messages)


def llamacpp_greedy(path: Path, ids: list[int], steps: int, threads: int, forced=None):
    """llama.cpp's greedy continuation of ``ids``: ``(tokens [steps], logits [steps + 1, V])``
    (the logits after the prompt and after each generated token). With ``forced`` (a token
    list) those tokens are fed instead of the argmax (teacher forcing)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=len(ids) + steps + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def last() -> np.ndarray:
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()

    llm.eval(ids)
    rows, tokens = [last()], []
    for step in range(steps):
        tokens.append(int(rows[-1].argmax()) if forced is None else forced[step])
        llm.eval([tokens[-1]])
        rows.append(last())
    return tokens, np.stack(rows)


def hisparse_logits(weights, ids: list[int], last: int) -> torch.Tensor:
    """Dense float32 forward of the placed model over ``ids``; logits of the last ``last``
    positions ``[last, V]`` (the ``cpu`` preset's weight placement: float)."""
    from engine.model.llama import LlamaModel, prefill_attention

    cfg = weights.config
    _, rope = context_limit_and_rope(cfg, EngineConfig())
    model = LlamaModel(weights, torch.device("cpu"), torch.float32, "float", rope)
    x = torch.tensor(ids)
    with torch.no_grad():
        h = model.embed_tokens(x)
        positions = torch.arange(len(ids))
        for i in range(cfg.num_layers):
            q, k, v = model.qkv(i, h, positions)
            h = model.finish_layer(i, h, prefill_attention(q, k, v, 0))
        return model.logits(h[-last:]).float()


def compare(ours: torch.Tensor, ref: np.ndarray) -> dict:
    ref_t = torch.from_numpy(ref).float()
    diff = (ours - ref_t).abs()
    agree = ours.argmax(-1) == ref_t.argmax(-1)
    lead = int(agree.long().cumprod(0).sum())  # leading positions in agreement
    return {
        "positions": int(agree.numel()),
        "top1_agreement": round(float(agree.float().mean()), 4),
        "max_abs_logit_diff": round(float(diff.max()), 4),
        "mean_abs_logit_diff": round(float(diff.mean()), 4),
        "ref_logit_std": round(float(ref_t.std()), 4),
        "greedy_tokens_equal_leading": min(lead, agree.numel() - 1),
    }


# ----------------------------------------------------------------------------- (c) run


def hisparse_run(
    path: Path, doc: Path, out_dir: Path, steps: int, threads: int, host_pool_gb: float
) -> dict:
    """``hisparse run`` as a user types it (plus ``--host-pool``: on a shared box the
    preset's 8 GiB pool can exceed the memory available; a 3K-token job needs a few MiB,
    and the pool's size changes no output); returns the summary text, the model line and
    the wall time."""
    cmd = [
        sys.executable, "-m", "hisparse_cli", "run", str(doc), "--model", str(path),
        "--preset", "cpu", "--max-new-tokens", str(steps), "--output-dir", str(out_dir),
        "--threads", str(threads), "--host-pool", str(host_pool_gb), "--force",
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    line = next((ln.strip() for ln in log.splitlines() if "linears:" in ln), "")
    text_file = out_dir / f"{doc.stem}.txt"
    return {
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "model_line": line,
        "summary": text_file.read_text() if text_file.is_file() else None,
        "log_tail": log[-1500:] if proc.returncode else "",
    }


# ----------------------------------------------------------------------------- main


def check_file(name: str, path: Path, args, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    weights, _, _ = load_weights(str(path))
    row: dict = {
        "type": name,
        "file": str(path),
        "file_mib": round(path.stat().st_size / 2**20, 1),
        "tensor_types": tensor_types(path),
        "model_line_float": describe_placement(weights.formats, "float", "float32"),
        "model_line_int4": describe_placement(weights.formats, "int4", "bfloat16"),
        "load_s": round(time.perf_counter() - t0, 1),
    }
    tokens, ref = llamacpp_greedy(path, ids, args.max_new_tokens, args.threads)
    ours = hisparse_logits(weights, ids + tokens, len(tokens) + 1)
    del weights
    row["teacher_forced"] = compare(ours, ref)
    row["llamacpp_greedy_tokens"] = tokens
    if args.control and name != "F32":
        # llama.cpp on the same weights decoded to F32 (gguf-py): separates how each engine
        # reads the blocks from llama.cpp's quantised-kernel arithmetic (Q8_K activations).
        decoded = write_f32_copy(path, args.work_dir / f"decoded_{name}.gguf")
        _, ctrl = llamacpp_greedy(decoded, ids, len(tokens), args.threads, forced=tokens)
        decoded.unlink()
        row["vs_llamacpp_on_decoded_f32"] = compare(ours, ctrl)
        row["llamacpp_q_vs_llamacpp_decoded_f32"] = compare(torch.from_numpy(ref), ctrl)
    if not args.skip_run:
        row["run"] = hisparse_run(
            path,
            args.doc,
            args.work_dir / f"run_{name}",
            args.max_new_tokens,
            args.threads,
            args.host_pool_gb,
        )
    print(f"  {name}: {json.dumps(row['teacher_forced'])}", flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    head = "| type | MiB | top-1 agree | max / mean |Δlogit| | greedy equal | vs llama.cpp on decoded F32: top-1, max / mean | run |"
    print("\n" + head + "\n|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['type']} | – | – | – | – | {r['error']} |")
            continue
        tf = r["teacher_forced"]
        run = r.get("run", {})
        status = "skipped" if not run else f"exit {run['exit_code']}, {run['wall_s']} s"
        c = r.get("vs_llamacpp_on_decoded_f32")
        ctrl = (
            "–"
            if c is None
            else (
                f"{c['top1_agreement']:.3f}, {c['max_abs_logit_diff']:.3f} / "
                f"{c['mean_abs_logit_diff']:.4f}"
            )
        )
        print(
            f"| {r['type']} | {r['file_mib']} | {tf['top1_agreement']:.3f} | "
            f"{tf['max_abs_logit_diff']:.2f} / {tf['mean_abs_logit_diff']:.3f} | "
            f"{tf['greedy_tokens_equal_leading']}/{tf['positions'] - 1} | {ctrl} | {status} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kquants"))
    ap.add_argument("--doc", type=Path, default=ROOT / "examples" / "howto-sorting.txt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host-pool-gb", type=float, default=1.0, help="hisparse run --host-pool")
    ap.add_argument("--skip-run", action="store_true", help="leave out (c), hisparse run")
    ap.add_argument("--with-source", action="store_true", help="also check the F32 source")
    ap.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="leave out llama.cpp on each file's weights decoded to F32",
    )
    ap.add_argument("--out", type=Path, default=Path("docs/bench/kquants_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    import llama_cpp

    src = args.work_dir / "smollm2-135m-f32.gguf"
    if not src.is_file():
        write_f32_copy(default_model_path(), src)
    _, tokenizer, _ = load_weights(str(src))
    ids = prompt_ids(tokenizer, args.doc)
    print(f"prompt: {len(ids)} tokens of {args.doc.name}; llama-cpp-python {llama_cpp.__version__}")
    rows = []
    names = list(args.types) + (["F32"] if args.with_source else [])
    for name in names:
        path = src if name == "F32" else args.work_dir / f"smollm2-135m-{name}.gguf"
        try:
            if not path.is_file():
                quantize(src, path, name, args.threads)
        except (RuntimeError, AttributeError) as exc:
            rows.append({"type": name, "error": f"not quantised: {exc}"})
            print(f"  {name}: {rows[-1]['error']}", flush=True)
            continue
        rows.append(check_file(name, path, args, ids))
        write_json(args, rows, ids)  # after each file: a long run keeps what it has
    print_table(rows)
    write_json(args, rows, ids)
    print(f"wrote {args.out}")


def write_json(args, rows: list[dict], ids: list[int]) -> None:
    import llama_cpp

    result = {
        "command": " ".join(sys.argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": os.uname().nodename,
        "loadavg_end": os.getloadavg(),
        "llama_cpp_python": llama_cpp.__version__,
        "torch": torch.__version__,
        "source": str(default_model_path()),
        "doc": str(args.doc),
        "prompt_tokens": len(ids),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
