"""Pre-quantised Hugging Face folders (AWQ, GPTQ) read as :class:`Int4Weight`, still 4-bit.

A folder's ``config.json`` ``quantization_config`` names the method. Two are read, both
asymmetric 4-bit with per-group fp16 scales and 4-bit zero points, which map exactly onto
``W[n, k] = scale[n, k // g] * q[n, k] + offset[n, k // g]`` with ``scale = s`` and
``offset = -z * s`` (float32: ``z * s`` of an fp16 ``s`` and ``z <= 16`` is exact, and so
is the difference, so this equals the formats' own ``(q - z) * s``):

* **AWQ, GEMM layout** (``quant_method: awq``, ``version: gemm``; AutoAWQ's
  ``WQLinear_GEMM``, transformers' ``AwqConfig``): per linear ``qweight`` int32
  ``[K, N/8]``, ``qzeros`` int32 ``[K/g, N/8]``, ``scales`` fp16 ``[K/g, N]``. Word
  ``qweight[k, c]`` holds output columns ``8c .. 8c+7``; its nibble ``i`` (bits ``4i``) is
  column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`` (AutoAWQ
  ``awq/modules/linear/gemm.py``, the ``order_map`` of ``from_linear``; unpacked with the
  inverse ``(0, 4, 1, 5, 2, 6, 3, 7)``). ``qzeros`` packs the zero points the same way,
  stored as they are.
* **GPTQ, v1 checkpoint format** (``quant_method: gptq``, ``checkpoint_format: gptq`` or
  absent, ``desc_act: false``; AutoGPTQ / GPTQModel ``QuantLinear.pack``): ``qweight`` int32
  ``[K/8, N]`` whose word ``[r, n]`` holds input rows ``8r .. 8r+7`` in nibble order
  (bits ``4j`` = row ``8r + j``); ``qzeros`` int32 ``[K/g, N/8]``, nibble ``j`` of word
  ``[G, c]`` = zero point of column ``8c + j`` minus one (the v1 convention; read back as
  ``nibble + 1``, as AutoGPTQ's kernels do, so 1..16); ``scales`` ``[K/g, N]``; ``g_idx``
  int32 ``[K]`` must be ``k // g`` (no act-order).

Group sizes: the engine's int4 kernels take g in :data:`GROUP_SIZES`. A checkpoint group
that is a multiple of one (``group_size: -1`` = one group per row, or 512, 1024 ...) is
kept exact by repeating each scale/offset over the smaller groups. Any other group
(e.g. 16, or a K with no such divisor) is decoded to float32 (exact values) and recorded as
``<METHOD>-g<G>``; int4 placement then re-quantises it and the model line says so.

Everything else (GPTQ ``desc_act: true``, ``bits != 4``, the ``gptq_v2`` / Marlin /
BitBLAS checkpoint formats, AWQ GEMV / Marlin / exllama layouts, bitsandbytes, FP8,
compressed-tensors, EXL2 ...) is refused by :func:`read_quant_config` with what is read and
what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.weights.quant import INT4_GROUP_SIZES as GROUP_SIZES
from engine.weights.quant import Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SUPPORTED = (
    "AWQ (quant_method 'awq', version 'gemm', bits 4) and GPTQ (quant_method 'gptq', "
    "checkpoint_format 'gptq' = v1, bits 4, desc_act false)"
)
INSTEAD = (
    "Use the original float checkpoint (4-bit at load, or once with `hisparse quantize`) "
    "or a GGUF file (Q4_0, Q4_1, Q4_K run as stored; other types re-quantised)"
)
# Tensors a pre-quantised linear module stores instead of ``.weight``.
AWQ_TENSORS = ("qweight", "qzeros", "scales")
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


class PrequantError(ValueError):
    """A ``quantization_config`` or pre-quantised tensor this engine does not read."""


@dataclass(frozen=True)
class PrequantFormat:
    """What a folder's ``quantization_config`` declares.

    method : ``"awq"`` or ``"gptq"``
    group_size : input elements per scale (``K`` itself for ``group_size: -1``: resolved
        per weight, stored here as -1)
    unquantised : ``modules_to_not_convert``: module name parts whose linears stay float
    """

    method: str
    group_size: int
    unquantised: tuple[str, ...] = ()

    def keeps_float(self, module: str) -> bool:
        """Whether ``module`` (e.g. ``model.layers.0.mlp.gate_proj``) is left float (a
        substring match, as transformers' ``modules_to_not_convert``)."""
        return any(part in module for part in self.unquantised)

    @property
    def tensors(self) -> tuple[str, ...]:
        return AWQ_TENSORS if self.method == "awq" else GPTQ_TENSORS

    def label(self, group_size: int) -> str:
        """The ``ModelWeights.formats`` value of one weight, e.g. ``AWQ-g128``."""
        return f"{self.method.upper()}-g{group_size}"


def read_quant_config(raw: dict, path: Path | str) -> PrequantFormat | None:
    """Check ``raw["quantization_config"]`` of a ``config.json``; None when there is none.

    Raises
    ------
    PrequantError
        Any method or variant other than AWQ GEMM 4-bit and GPTQ v1 4-bit without act-order;
        the message names the field, what is supported and what to use instead.
    """
    quant = raw.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        _refuse(path, f"quantization_config={quant!r}")
    method = str(quant.get("quant_method", "?")).lower()
    if method not in ("awq", "gptq"):
        _refuse(path, f"quantization_config (quant_method={method!r})")
    where = f"quantization_config.{{}} of a {method.upper()} folder"
    bits = quant.get("bits", quant.get("w_bit", 4))
    if bits != 4:
        _refuse(path, where.format(f"bits={bits!r}"))
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            _refuse(path, where.format(f"version={version!r} (layout)"))
        backend = str(quant.get("backend", "autoawq")).lower()
        if backend != "autoawq":
            _refuse(path, where.format(f"backend={backend!r} (llm-awq packing)"))
        if quant.get("zero_point") is False:
            _refuse(path, where.format("zero_point=false"))
    else:
        fmt = quant.get("checkpoint_format", quant.get("format", "gptq"))
        if str(fmt).lower() != "gptq" or quant.get("is_marlin_format"):
            shown = "marlin" if quant.get("is_marlin_format") else fmt
            _refuse(path, where.format(f"checkpoint_format={shown!r}"))
        if quant.get("desc_act"):
            _refuse(path, where.format("desc_act=true (act-order, permuted groups)"))
    if quant.get("lm_head"):
        _refuse(path, where.format("lm_head=true (a 4-bit LM head)"))
    group = quant.get("group_size", quant.get("q_group_size", 128))
    if not isinstance(group, int) or (group <= 0 and group != -1):
        _refuse(path, where.format(f"group_size={group!r}"))
    skip = quant.get("modules_to_not_convert") or ()
    return PrequantFormat(method, group, tuple(str(m) for m in skip))


def _refuse(path: Path | str, what: str) -> None:
    raise PrequantError(
        f"{path}: {what} is not supported: supported pre-quantised folders are "
        f"{SUPPORTED}. {INSTEAD}"
    )


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., C]`` -> int32 ``[..., C, 8]`` of the eight nibbles, bits ``4i`` at ``i``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words[..., None] >> shifts) & 0xF


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    """AWQ GEMM tensors of one linear -> :class:`Int4Weight` ``[N, K]`` of the file's group.

    Parameters
    ----------
    qweight : int32 ``[K, N/8]``; qzeros : int32 ``[K/g, N/8]``; scales : float ``[K/g, N]``
    (layouts in the module docstring).
    """
    k = qweight.shape[0]
    order = torch.tensor(AWQ_REVERSE_ORDER)
    q = unpack_nibbles(qweight)[..., order].reshape(k, -1).T  # [N, K]
    z = unpack_nibbles(qzeros)[..., order].reshape(qzeros.shape[0], -1).T  # [N, K/g]
    return _int4(q, z, scales.T)


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    """GPTQ v1 tensors of one linear -> :class:`Int4Weight` ``[N, K]`` of the file's group.

    Parameters
    ----------
    qweight : int32 ``[K/8, N]``; qzeros : int32 ``[K/g, N/8]`` (zero − 1);
    scales : float ``[K/g, N]`` (layouts in the module docstring).
    """
    n = qweight.shape[1]
    q = unpack_nibbles(qweight).permute(0, 2, 1).reshape(-1, n).T  # [N, K]
    z = unpack_nibbles(qzeros).reshape(qzeros.shape[0], -1).T + 1  # [N, K/g], 1..16
    return _int4(q, z, scales.T)


def _int4(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> Int4Weight:
    n, k = q.shape
    s = s.to(torch.float32).contiguous()
    v = q.to(torch.uint8).reshape(n, k // 2, 2)
    packed = (v[..., 0] | (v[..., 1] << 4)).contiguous()
    offset = (-(z.to(torch.float32) * s)).contiguous()  # z is a transposed view: its layout
    return Int4Weight(packed, s, offset, k // s.shape[1])


def fit_group(w: Int4Weight) -> Int4Weight | None:
    """``w`` with a group size the int4 kernels take (:data:`GROUP_SIZES`), exactly: the
    same weight when it has one; for a multiple of one, each scale/offset repeated over the
    largest such divisor; None when no supported size divides the group."""
    g = w.group_size
    if g in GROUP_SIZES:
        return w
    fits = [s for s in GROUP_SIZES if g % s == 0]
    if not fits:
        return None
    r = g // max(fits)
    return Int4Weight(
        w.q, w.scale.repeat_interleave(r, 1), w.offset.repeat_interleave(r, 1), max(fits)
    )


def check_g_idx(g_idx: torch.Tensor, group_size: int, where: str) -> None:
    """A GPTQ ``g_idx [K]`` must be ``k // group_size`` (no act-order).

    Raises
    ------
    PrequantError
        Another order (act-order stored with ``desc_act: false``).
    """
    want = torch.arange(g_idx.shape[0]) // group_size
    if not torch.equal(g_idx.to(torch.int64), want):
        raise PrequantError(
            f"{where}: g_idx is not k // {group_size} (act-order weights) and is not "
            f"supported: supported pre-quantised folders are {SUPPORTED}. {INSTEAD}"
        )
