"""``hisparse quantize``: write a 4-bit copy of a Hugging Face model folder.

Every linear weight ``model.layers.<i>.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}
.weight`` ``[N, K]`` is quantised with :func:`engine.weights.quant.quantize_int4` (asymmetric
min/max groups of ``g`` along K) and stored as three tensors of the module:

* ``<module>.qweight``: uint8 ``[N, K/2]``, two nibbles per byte (element ``2i`` low);
* ``<module>.scales``: float32 ``[N, K/g]``;
* ``<module>.offsets``: float32 ``[N, K/g]``; ``W = scales * q + offsets`` per group.

``g`` is the requested group size (default 128), or for a K that is not a multiple of it
the largest of 64, 32 that is (SmolLM2-135M's hidden size 576 gets 64); the loader reads
each weight's group size off its ``scales`` shape.

Scales and offsets stay float32 so that loading gives back exactly
``quantize_int4(W).dequantize()`` (fp16 would round them; it costs 0.25 bit/weight at
g=128). Everything else (embeddings, ``lm_head``, norms, q/k/v biases) is copied
unquantised in its stored dtype (16-bit for the usual bf16/fp16 checkpoints).

The output folder holds ``model.safetensors`` (one file; safetensors ``__metadata__``
``{"format": "pt", "hisparse_format": "int4-g<G>", "hisparse_group_size": "<G>"}``) and
copies of ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json`` and ``chat_template.jinja`` where present.
:func:`engine.weights.hf.load_hf_folder` reads it back as :class:`engine.weights.quant.Int4Weight`.

The safetensors file is streamed: its header is built from the source shapes, then one
tensor at a time is read, quantised and written, so memory stays near one tensor.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.weights.hf import (
    FORMAT_KEY,
    GROUP_SIZE_KEY,
    GROUP_SIZES,
    LINEAR_WEIGHT,
    OFFSETS,
    QWEIGHT,
    SCALES,
    SINGLE_FILE,
    HFModelError,
    SafetensorsFolder,
    check_names,
    expected_shapes,
    group_size_for,
    int4_format,
    quantized_group_size,
    read_hf_config,
)
from engine.weights.quant import quantize_int4

COPIED_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)
_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
}
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1}


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_folder` did. ``num_smaller_group``: linears whose K needed a
    smaller group than ``group_size``. Byte counts are of the safetensors files only."""

    src: Path
    out: Path
    group_size: int
    num_quantized: int
    num_smaller_group: int
    num_copied: int
    src_bytes: int
    out_bytes: int
    copied_files: tuple[str, ...]

    @property
    def ratio(self) -> float:
        return self.out_bytes / self.src_bytes if self.src_bytes else 0.0


@dataclass(frozen=True)
class _Block:
    """Consecutive output tensors produced together: specs ``(name, dtype, shape)``."""

    specs: list[tuple[str, str, tuple[int, ...]]]
    produce: Callable[[], list[torch.Tensor]]
    group_size: int | None = None  # of a quantised linear


def _not_a_folder(src: Path) -> str:
    """Why ``src``, which exists but is no folder, cannot be quantised, and what to pass."""
    if not src.is_file():
        return f"{src} is not a folder (a pipe or a device): {_TAKES}"
    message = f"{src} is a file, not a model folder: {_TAKES}"
    with src.open("rb") as f:
        gguf = f.read(4) == b"GGUF"
    if gguf:
        message += (
            "; a GGUF file needs no quantize step: pass it to `hisparse run --model` as it is "
            "(its Q4_0, Q4_1 and Q4_K weights are used as stored)"
        )
    elif src.name == "config.json":
        message += f"; pass the folder holding it, {src.parent}"
    return message


_TAKES = "quantize takes a Hugging Face model folder (config.json + *.safetensors)"


def quantize_folder(
    src: str | Path,
    out: str | Path,
    group_size: int = 128,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> QuantizeReport:
    """Quantise the linear weights of the model folder ``src`` into the folder ``out``.

    Parameters
    ----------
    src : Hugging Face folder (``config.json`` + safetensors, single or sharded)
    out : output folder (created)
    group_size : g, elements per scale/offset group along K: 32, 64, 128 or 256 (smaller
        for a weight whose K it does not divide)
    overwrite : replace the files of ``out`` it writes (:func:`output_files`) that exist
    progress : called with each tensor name as it is written

    Returns
    -------
    QuantizeReport

    Raises
    ------
    FileNotFoundError
        ``src`` or its ``config.json`` is missing.
    FileExistsError
        One of the files it would write (:func:`output_files`: ``model.safetensors``,
        ``config.json``, the tokenizer files) exists in ``out`` and ``overwrite`` is
        False; found before any work.
    HFModelError (a ValueError)
        ``src`` is a file (a GGUF file, a ``config.json``), not a folder; ``out`` or a
        folder above it is a file; what
        :func:`engine.weights.hf.load_hf_folder` refuses, an already quantised source, a
        bad ``group_size`` or a K not divisible by 32 (names the tensor).
    """
    src, out = Path(src), Path(out)
    if group_size not in GROUP_SIZES:
        raise HFModelError(f"group_size={group_size} is not one of {GROUP_SIZES}")
    if src.exists() and not src.is_dir():
        raise HFModelError(_not_a_folder(src))
    if not src.is_dir():
        raise FileNotFoundError(f"model folder not found: {src}")
    placed = next((p for p in (out, *out.parents) if p.exists()), None)
    if placed is not None and not placed.is_dir():  # found now, not after the work
        what = "exists and is not a folder" if placed == out else f"{placed} is not a folder"
        raise HFModelError(
            f"{out}: {what}: the output is a folder (model.safetensors, config.json and the "
            "tokenizer files); give a new folder's name"
        )
    target = out / SINGLE_FILE
    if out.resolve() == src.resolve():
        raise HFModelError(f"{out}: the output folder must differ from the source")
    existing = existing_outputs(src, out)
    if existing and not overwrite:
        names = ", ".join(map(str, existing))
        raise FileExistsError(f"{names} exist(s) (overwrite=True replaces them)")
    cfg = read_hf_config(src)
    if "quantization_config" in json.loads((src / "config.json").read_text()):
        raise HFModelError(
            f"{src / 'config.json'}: quantization_config: already quantised (AWQ/GPTQ); "
            "pass the folder to --model as it is (its 4-bit weights are used as stored)"
        )
    with SafetensorsFolder(src) as tensors:
        if quantized_group_size(tensors) is not None:
            raise HFModelError(f"{src}: already quantised ({tensors.metadata[FORMAT_KEY]})")
        check_names(tensors, cfg, quantized=False)
        shapes = expected_shapes(cfg)
        blocks = [
            block
            for name in sorted(tensors.names)
            if (block := _block(tensors, name, shapes.get(name), group_size)) is not None
        ]
        src_bytes = sum(f.stat().st_size for f in set(tensors.file_of.values()))
        out.mkdir(parents=True, exist_ok=True)
        metadata = {
            "format": "pt",
            FORMAT_KEY: int4_format(group_size),
            GROUP_SIZE_KEY: str(group_size),
        }
        write_safetensors(target, blocks, metadata, progress)
    copied = tuple(name for name in COPIED_FILES if _copy(src / name, out / name))
    return QuantizeReport(
        src=src,
        out=out,
        group_size=group_size,
        num_quantized=sum(len(b.specs) == 3 for b in blocks),
        num_smaller_group=sum(b.group_size not in (None, group_size) for b in blocks),
        num_copied=sum(len(b.specs) == 1 for b in blocks),
        src_bytes=src_bytes,
        out_bytes=target.stat().st_size,
        copied_files=copied,
    )


def output_files(src: str | Path, out: str | Path) -> list[Path]:
    """The files :func:`quantize_folder` writes in ``out``: ``model.safetensors`` and
    each of :data:`COPIED_FILES` that ``src`` has."""
    src, out = Path(src), Path(out)
    copied = [out / name for name in COPIED_FILES if (src / name).is_file()]
    return [out / SINGLE_FILE, *copied]


def existing_outputs(src: str | Path, out: str | Path) -> list[Path]:
    """Those of :func:`output_files` that exist already (a file, a link, a folder)."""
    return [p for p in output_files(src, out) if os.path.lexists(p)]


def _block(
    tensors: SafetensorsFolder, name: str, shape: tuple[int, ...] | None, group_size: int
) -> _Block | None:
    """The output of one source tensor: three 4-bit tensors for a linear, else a copy."""
    if shape is None:  # ignored buffer (rotary inv_freq) or an lm_head copy of a tied model
        return None
    if not LINEAR_WEIGHT.match(name):
        tensors.check(name, shape, ("F32", "F16", "BF16"))
        return _Block([(name, tensors.dtype(name), shape)], lambda: [tensors.get(name)])
    n, k = shape
    try:
        g = group_size_for(k, group_size)
    except ValueError as exc:
        raise HFModelError(f"{tensors.where(name)}: {exc}") from None
    tensors.check(name, shape, ("F32", "F16", "BF16"))
    module = name[: -len(".weight")]
    specs: list[tuple[str, str, tuple[int, ...]]] = [
        (f"{module}.{QWEIGHT}", "U8", (n, k // 2)),
        (f"{module}.{SCALES}", "F32", (n, k // g)),
        (f"{module}.{OFFSETS}", "F32", (n, k // g)),
    ]

    def produce() -> list[torch.Tensor]:
        w = quantize_int4(tensors.get(name).to(torch.float32), g)
        return [w.q, w.scale, w.offset]

    return _Block(specs, produce, g)


def write_safetensors(
    path: Path,
    blocks: list[_Block],
    metadata: dict[str, str],
    progress: Callable[[str], None] | None = None,
) -> None:
    """Stream ``blocks`` into a safetensors file (header first, then each tensor's bytes).

    The header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` and
    ``__metadata__``, space-padded to a multiple of 8 bytes) is built from the declared
    specs; each produced tensor is checked against its spec before being written.

    Raises
    ------
    HFModelError
        A produced tensor differs from its declared dtype or shape.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for block in blocks:
        for name, dtype, shape in block.specs:
            size = _DTYPE_BYTES[dtype] * _numel(shape)
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for block in blocks:
            for (name, dtype, shape), t in zip(block.specs, block.produce(), strict=True):
                if _DTYPE_NAMES.get(t.dtype) != dtype or tuple(t.shape) != tuple(shape):
                    raise HFModelError(
                        f"{name}: produced {t.dtype} {tuple(t.shape)}, declared {dtype} {shape}"
                    )
                f.write(t.contiguous().view(torch.uint8).numpy().data)
                if progress is not None:
                    progress(name)
    tmp.replace(path)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _copy(src: Path, dst: Path) -> bool:
    if not src.is_file():
        return False
    shutil.copyfile(src, dst)
    return True
