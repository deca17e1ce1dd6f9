"""How the loader places weights, as rules that need no torch: ``weight_format: auto``'s
choice (:func:`auto_weight_format`), the CPU feature it reads (:func:`cpu_fast_bf16`), the
group a float linear is re-quantised with (:func:`requant_group_size`) and the CPU LM
head's recorded fp16 choice (:func:`recorded_cpu_lm_head_fp16`).

:func:`engine.load.place_model` places a model by these rules and the capacity planner
(:mod:`engine.capacity.planner`, which imports no torch) counts the weights by the same
ones, so ``hisparse plan`` counts the bytes ``hisparse run`` places.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

# Source formats whose 4-bit codes placement keeps as they are (GGUF types; ``hisparse
# quantize`` folders record ``int4-g<G>``, AWQ/GPTQ folders ``AWQ-g<G>`` / ``GPTQ-g<G>``).
INT4_SOURCE_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
# Decoder-layer linear weights: GGUF tensor names and Hugging Face module names.
LINEAR_NAME = re.compile(
    r"^blk\.\d+\.(attn_[qkv]|attn_qkv|attn_output|ffn_(gate|up|down))\.weight$"
    r"|^model\.layers\.\d+\.(self_attn\.([qkvo]|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)"
    r"(\.weight)?$"
)


def is_int4(fmt: str) -> bool:
    """Whether source format ``fmt`` is 4-bit codes the int4 kernels take as they are."""
    return fmt in INT4_SOURCE_FORMATS or fmt.startswith(("int4-g", "AWQ-g", "GPTQ-g"))


def linears_stored_int4(formats: Mapping[str, str]) -> bool:
    """Whether every decoder-layer linear of ``formats`` (``ModelWeights.formats``, or a
    GGUF header's tensor types) is stored in a 4-bit format the int4 kernels take as is
    (no re-quantisation); ``False`` when there are none."""
    linears = [fmt for name, fmt in formats.items() if LINEAR_NAME.match(name)]
    return bool(linears) and all(is_int4(fmt) for fmt in linears)


def auto_weight_format(
    device: str, linears_int4: bool, fast_bf16: Callable[[], bool] | None = None
) -> str:
    """``weight_format: auto`` on ``device`` (``cpu``, ``cuda``, ``cuda:N``): ``int4`` on
    CUDA; on a CPU ``int4`` only where it is faster and changes no weight: a CPU with bf16
    instructions (``fast_bf16``, default :func:`cpu_fast_bf16`: AVX512-BF16 or AMX, where
    the int4 kernel with bf16 activations beats fp32 GEMM at decode) and linears stored
    4-bit (``linears_int4``: a float checkpoint would be re-quantised); ``float``
    elsewhere (AVX2 and other CPUs, where it is slower; docs/performance.md, "CPU decode
    path")."""
    if str(device).split(":")[0] != "cpu":
        return "int4"
    fast = cpu_fast_bf16 if fast_bf16 is None else fast_bf16
    return "int4" if linears_int4 and fast() else "float"


def cpu_int4_dtype_name(dtype: str, fast_bf16: bool) -> str:
    """Activation dtype of torch's CPU int4 kernel for a model computing in ``dtype``:
    ``bfloat16`` on a CPU with bf16 instructions, else ``dtype``."""
    return "bfloat16" if fast_bf16 else dtype


def requant_group_size(in_features: int) -> int:
    """Group of a float linear ``[N, K]`` quantised to int4 at load (``quantize_int4``):
    128 where ``K`` is a multiple of it, else 32."""
    return 128 if in_features % 128 == 0 else 32


BF16_CPU_FLAGS = ("avx512_bf16", "amx_tile")
"""``/proc/cpuinfo`` flags of the instructions :func:`cpu_fast_bf16` looks for; torch's own
checks are ``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``."""


@functools.cache
def cpu_fast_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), which
    torch's CPU int4 kernel uses with bf16 activations.

    Measured on an AVX512-BF16/AMX Xeon (docs/performance.md, "CPU decode path"):
    ``_weight_int4pack_mm_for_cpu`` with bf16 activations 1.3-2.2x faster than fp32
    ``F.linear`` on SmolLM2's layers at one row, 4-30x slower with fp32 activations; on the
    AVX2-only EPYC of 2026-12-01 slower than fp32 even with bf16.

    Read from the kernel's CPU flags (``/proc/cpuinfo``; Linux lists AVX-512 and AMX
    features only where it enables their register state, as torch's cpuinfo checks), so
    the answer is the same on every run of a machine, costs no timed probe, and needs no
    torch: ``hisparse plan`` asks the same question without importing it. A Linux CPU
    without a ``flags`` line (ARM) has neither instruction. Where ``/proc/cpuinfo`` cannot
    be read (macOS, Windows) torch's own checks answer.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        import torch

        cpu = getattr(torch, "cpu", None)
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)
    return any(flag in flags for flag in BF16_CPU_FLAGS)


# ----------------------------------------------------------------------------- CPU LM head


def lm_head_record_path() -> Path:
    """Where :func:`engine.weights.quant.pick_cpu_lm_head` keeps its choices:
    ``$HISPARSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/hisparse``, else ``~/.cache/hisparse``;
    file ``cpu_lm_head.json`` (a JSON object: key -> ``{"fp16": bool, "note": str}``).
    Delete it to measure again."""
    root = os.environ.get("HISPARSE_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "hisparse")
    return Path(root) / "cpu_lm_head.json"


def lm_head_key(shape: tuple[int, ...], torch_version: str) -> str:
    """A record's key: the CPU's model name (``/proc/cpuinfo``, else the platform's),
    torch's version and the head's ``V x H``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu} | torch {torch_version} | {'x'.join(map(str, shape))}"


def read_lm_head_records() -> dict:
    """The records of :func:`lm_head_record_path` (``{}`` when it cannot be read)."""
    try:
        data = json.loads(lm_head_record_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_lm_head_record(key: str, value: dict) -> None:
    """Add one record to :func:`lm_head_record_path`, atomically (a temporary file renamed
    over the old one); nothing when the folder cannot be written."""
    path = lm_head_record_path()
    data = {**read_lm_head_records(), key: value}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def recorded_cpu_lm_head_fp16(shape: tuple[int, int]) -> bool | None:
    """The CPU LM head choice recorded on this machine for a head of ``shape`` (``V, H``)
    under the installed torch: ``True`` fp16, ``False`` float32, ``None`` when none is
    recorded (the first load measures it). Needs no torch: its version is read from the
    installed distribution where torch is not imported."""
    torch = sys.modules.get("torch")
    try:
        version = torch.__version__ if torch is not None else importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    record = read_lm_head_records().get(lm_head_key(shape, str(version)))
    if isinstance(record, dict) and isinstance(record.get("fp16"), bool):
        return record["fp16"]
    return None
