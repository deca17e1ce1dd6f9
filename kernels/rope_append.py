"""RoPE of a decode step's queries and new key, fused with the key/value append.

Rotary position embedding (Su et al. 2021, arXiv:2104.09864) in the rotate-half layout of
Hugging Face transformers / GPT-NeoX (``rotate_half``: dimension ``j < D/2`` pairs with
``j + D/2``), the layout :mod:`engine.model.rope` uses for every model here; the
frequency scalings (``llama3``, ``dynamic``, ``yarn``, GGUF ``rope_freqs``) live in the
inverse frequencies, ``linear`` in a position divisor and YaRN's temperature in an
attention factor, so the kernel takes all three (:class:`RopeParams`).

:func:`rope_append_ref` is :func:`engine.model.rope.Rope.cos_sin` + ``apply_rope`` on q and
k, then :func:`kernels.append_kv.append_kv_ref` with the rotated key: the unfused path,
op for op (the CPU path's results are the unfused path's bit for bit). :func:`rope_append`
is one Triton launch, one program per (request, KV head): it computes cos/sin in
registers (float32, libdevice ``cos``/``sin`` on CUDA, as torch's kernels), rotates the
key and the head's ``G`` query heads with the reference's roundings (each product and
the sum rounded to the activation dtype, as the element-wise torch ops do), writes the
rotated q and k, and appends k and v exactly as :func:`kernels.append_kv.append_kv`
(staging, pool, metadata, resident tail slot, each behind its flag) — one kernel where
the unfused decode step ran ~20 (cos/sin, two rotations, the append).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_shape,
    check_tensor,
    interpreted,
    next_pow2,
    require,
    require_runnable,
)
from kernels.append_kv import (
    _fp8_exponent,
    _pow2,
    _round_e4m3,
    _store_exponents,
    _store_kv,
    _unused,
    _widen_meta,
    append_kv_ref,
    check_pool_writes,
    check_slot_writes,
)
from kernels.fp8_kv import FP8


@dataclass(frozen=True)
class RopeParams:
    """What a RoPE kernel needs of :class:`engine.model.rope.Rope`.

    Attributes
    ----------
    inv_freq : float32 ``[D / 2]`` inverse frequencies (scalings and frequency factors
        applied), on the compute device
    position_divisor : positions are divided by it (``linear`` scaling; 1 otherwise)
    attention_factor : cos and sin are multiplied by it (YaRN's temperature; 1 otherwise)
    """

    inv_freq: torch.Tensor
    position_divisor: float = 1.0
    attention_factor: float = 1.0


def rope_cos_sin_ref(
    positions: torch.Tensor, rope: RopeParams, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, D]`` in ``dtype`` for int positions ``[T]`` (float32 math, rounded
    once), as :meth:`engine.model.rope.Rope.cos_sin`."""
    inv = rope.inv_freq.to(positions.device)
    ang = positions.float()[:, None] / rope.position_divisor * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * rope.attention_factor).to(dtype), (emb.sin() * rope.attention_factor).to(
        dtype
    )


_COS_SIN_MEMO: list = []
"""The last CPU ``(key, rope, cos, sin)`` of :func:`_step_cos_sin`."""


def _step_cos_sin(
    positions: torch.Tensor, rope: RopeParams, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin_ref`, remembered for the last CPU call: every layer of a decode
    step rotates at the same positions with the same table, so on the CPU the ~10 small ops
    run once a step instead of once a layer. The key holds the positions' values, the
    table's identity and version and the dtype, so the result is the one the call would
    compute. On other devices (reading the positions would synchronise) it always computes.
    """
    if positions.device.type != "cpu" or positions.numel() > 256:
        return rope_cos_sin_ref(positions, rope, dtype)
    inv = rope.inv_freq
    key = (
        tuple(positions.tolist()), inv.data_ptr(), inv._version, inv.device,
        rope.position_divisor, rope.attention_factor, dtype,
    )  # fmt: skip
    if _COS_SIN_MEMO and _COS_SIN_MEMO[0] == key and _COS_SIN_MEMO[1] is rope:
        return _COS_SIN_MEMO[2], _COS_SIN_MEMO[3]
    cos, sin = rope_cos_sin_ref(positions, rope, dtype)
    _COS_SIN_MEMO[:] = [key, rope, cos, sin]
    return cos, sin


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated with ``cos, sin [T, D]``: ``x * cos + rotate_half(x) * sin``,
    as :func:`engine.model.rope.apply_rope`."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def rope_append_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeParams,
    block_table: torch.Tensor,
    kv_pool: torch.Tensor,
    meta: torch.Tensor | None,
    kv_slots: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    slab_ids: torch.Tensor | None = None,
    *,
    write_pool: bool = True,
    staging: torch.Tensor | None = None,
    fp8: bool = False,
    pool_scale: torch.Tensor | None = None,
    slot_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at ``positions``, then append the rotated key and ``v``.

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries before RoPE; k, v : ``[B, Hkv, D]`` new key (before RoPE)
        and value; ``Hq`` a multiple of ``Hkv``; any strides (views of a fused qkv output)
    positions : int ``[B]`` 0-based position of the new token
    rope : :class:`RopeParams`
    block_table, kv_pool, meta, kv_slots, page_table, slab_ids, write_pool, staging, fp8,
        pool_scale, slot_scale : as :func:`kernels.append_kv.append_kv_ref` (receive the
        rotated key; with ``fp8`` it is rounded through fp8 where the append rounds it)

    Returns
    -------
    ``(q_rot [B, Hq, D], k_rot [B, Hkv, D])`` in the inputs' dtype
    """
    cos, sin = _step_cos_sin(positions, rope, q.dtype)
    q_rot, k_rot = rotate_half_ref(q, cos, sin), rotate_half_ref(k, cos, sin)
    append_kv_ref(
        k_rot,
        v,
        positions,
        block_table,
        kv_pool,
        meta,
        kv_slots,
        page_table,
        slab_ids,
        write_pool=write_pool,
        staging=staging,
        fp8=fp8,
        pool_scale=pool_scale,
        slot_scale=slot_scale,
    )
    return q_rot, k_rot


@triton.jit
def _rotate_half(x1, x2, c, s, OUT_DTYPE: tl.constexpr):
    """Both halves of a rotate-half RoPE, each product and sum rounded to ``OUT_DTYPE``
    (float32 math), as the element-wise torch ops of the reference round them."""
    a1 = (x1 * c).to(OUT_DTYPE).to(tl.float32)
    b1 = (-x2 * s).to(OUT_DTYPE).to(tl.float32)
    a2 = (x2 * c).to(OUT_DTYPE).to(tl.float32)
    b2 = (x1 * s).to(OUT_DTYPE).to(tl.float32)
    return (a1 + b1).to(OUT_DTYPE), (a2 + b2).to(OUT_DTYPE)


@triton.jit
def _rope_append_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    inv_freq_ptr,
    block_table_ptr,
    pool_ptr,
    meta_ptr,
    slots_ptr,
    page_table_ptr,
    slab_ids_ptr,
    staging_ptr,
    scale_ptr,
    slot_scale_ptr,
    num_kv_heads,
    inv_divisor,
    attention_factor,
    stride_q_b,
    stride_q_h,
    stride_k_b,
    stride_k_h,
    stride_v_b,
    stride_v_h,
    stride_qo_b,
    stride_qo_h,
    stride_ko_b,
    stride_ko_h,
    stride_bt_b,
    stride_pool_p,
    stride_pool_h,
    stride_pool_kv,
    stride_pool_s,
    stride_meta_p,
    stride_meta_h,
    stride_meta_mm,
    stride_slots_n,
    stride_slots_kv,
    stride_slots_s,
    stride_pt_slab,
    stride_slab_b,
    stride_slab_h,
    stride_st_b,
    stride_st_h,
    stride_st_kv,
    stride_sc_p,
    stride_sc_h,
    stride_sc_kv,
    stride_ss_n,
    stride_ss_kv,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    WRITE_POOL: tl.constexpr,
    HAS_META: tl.constexpr,
    HAS_STAGING: tl.constexpr,
    FP8: tl.constexpr,
    POOL_FP8: tl.constexpr,
    SLOTS_FP8: tl.constexpr,
):
    """One (request, KV head): cos/sin, the rotated key and ``GROUP`` query heads, then
    the append writes of :func:`kernels.append_kv._append_kv_kernel` (two halves; with
    ``FP8`` the rotated key and the value are rounded through fp8 after the staging copy,
    one scale per row over both halves)."""
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    pos = tl.load(positions_ptr + b).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    inv = tl.load(inv_freq_ptr + offs, mask=mask, other=0.0)
    ang = pos.to(tl.float32) * inv_divisor * inv
    if LIBDEVICE:
        cf = libdevice.cos(ang)
        sf = libdevice.sin(ang)
    else:  # the interpreter has no libdevice
        cf = tl.cos(ang)
        sf = tl.sin(ang)
    dt = q_out_ptr.dtype.element_ty
    c = (cf * attention_factor).to(dt).to(tl.float32)
    s = (sf * attention_factor).to(dt).to(tl.float32)

    for g in tl.static_range(GROUP):
        qh = h * GROUP + g
        src = q_ptr + b * stride_q_b + qh * stride_q_h + offs
        q1, q2 = _rotate_half(
            tl.load(src, mask=mask).to(tl.float32),
            tl.load(src + HALF, mask=mask).to(tl.float32),
            c,
            s,
            dt,
        )
        dst = q_out_ptr + b * stride_qo_b + qh * stride_qo_h + offs
        tl.store(dst, q1, mask=mask)
        tl.store(dst + HALF, q2, mask=mask)

    src = k_ptr + b * stride_k_b + h * stride_k_h + offs
    k1, k2 = _rotate_half(
        tl.load(src, mask=mask).to(tl.float32),
        tl.load(src + HALF, mask=mask).to(tl.float32),
        c,
        s,
        dt,
    )
    dst = k_out_ptr + b * stride_ko_b + h * stride_ko_h + offs
    tl.store(dst, k1, mask=mask)
    tl.store(dst + HALF, k2, mask=mask)
    vsrc = v_ptr + b * stride_v_b + h * stride_v_h + offs
    v1 = tl.load(vsrc, mask=mask)
    v2 = tl.load(vsrc + HALF, mask=mask)

    page = pos // PAGE_SIZE
    off = pos % PAGE_SIZE
    if WRITE_POOL or HAS_META:  # rope-only launches never read the block table
        pool_page = tl.load(block_table_ptr + b * stride_bt_b + page).to(tl.int64)
    else:
        pool_page = page

    if HAS_STAGING:
        st = staging_ptr + b * stride_st_b + h * stride_st_h + offs
        sdt = staging_ptr.dtype.element_ty
        tl.store(st, k1.to(sdt), mask=mask)
        tl.store(st + HALF, k2.to(sdt), mask=mask)
        tl.store(st + stride_st_kv, v1.to(sdt), mask=mask)
        tl.store(st + stride_st_kv + HALF, v2.to(sdt), mask=mask)

    k1r, k2r, v1r, v2r = k1, k2, v1, v2  # what an fp8 destination receives
    if FP8:  # as _append_kv_kernel: fp32-rounded e4m3 values, exact power-of-two scales
        k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
        v1f, v2f = v1.to(tl.float32), v2.to(tl.float32)
        ek = tl.maximum(_fp8_exponent(k1f, mask), _fp8_exponent(k2f, mask))
        ev = tl.maximum(_fp8_exponent(v1f, mask), _fp8_exponent(v2f, mask))
        k1r, k2r = _round_e4m3(k1f * _pow2(-ek)), _round_e4m3(k2f * _pow2(-ek))
        v1r, v2r = _round_e4m3(v1f * _pow2(-ev)), _round_e4m3(v2f * _pow2(-ev))
        vdt = v1.dtype
        k1, k2 = (k1r * _pow2(ek)).to(dt), (k2r * _pow2(ek)).to(dt)
        v1, v2 = (v1r * _pow2(ev)).to(vdt), (v2r * _pow2(ev)).to(vdt)

    if WRITE_POOL:
        rec = pool_ptr + pool_page * stride_pool_p + h * stride_pool_h + off * stride_pool_s + offs
        if POOL_FP8:
            _store_kv(rec, stride_pool_kv, k1r, v1r, mask)
            _store_kv(rec + HALF, stride_pool_kv, k2r, v2r, mask)
            sc = scale_ptr + pool_page * stride_sc_p + h * stride_sc_h + off
            _store_exponents(sc, stride_sc_kv, ek, ev)
        else:
            _store_kv(rec, stride_pool_kv, k1, v1, mask)
            _store_kv(rec + HALF, stride_pool_kv, k2, v2, mask)

    if HAS_META:
        meta = meta_ptr + pool_page * stride_meta_p + h * stride_meta_h + offs
        _widen_meta(meta, stride_meta_mm, k1, off == 0, mask)
        _widen_meta(meta + HALF, stride_meta_mm, k2, off == 0, mask)

    if HAS_SLOTS:
        slab = tl.load(slab_ids_ptr + b * stride_slab_b + h * stride_slab_h).to(tl.int64)
        slot = tl.load(page_table_ptr + slab * stride_pt_slab + page).to(tl.int64)
        if slot >= 0:  # (a name of its own: `rec` may be an fp8 pointer above)
            tail = slots_ptr + slot * stride_slots_n + off * stride_slots_s + offs
            if SLOTS_FP8:
                _store_kv(tail, stride_slots_kv, k1r, v1r, mask)
                _store_kv(tail + HALF, stride_slots_kv, k2r, v2r, mask)
                ss = slot_scale_ptr + slot * stride_ss_n + off
                _store_exponents(ss, stride_ss_kv, ek, ev)
            else:
                _store_kv(tail, stride_slots_kv, k1, v1, mask)
                _store_kv(tail + HALF, stride_slots_kv, k2, v2, mask)


def rope_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeParams,
    block_table: torch.Tensor,
    kv_pool: torch.Tensor,
    meta: torch.Tensor | None,
    kv_slots: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    slab_ids: torch.Tensor | None = None,
    *,
    write_pool: bool = True,
    staging: torch.Tensor | None = None,
    fp8: bool = False,
    pool_scale: torch.Tensor | None = None,
    slot_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`rope_append_ref`: same arguments and results, one launch.

    The rotated q and k match the reference to the device's float32 ``cos``/``sin``
    (libdevice on CUDA, as torch's CUDA kernels; numpy's under the interpreter); the pool,
    metadata, staging and slot writes are bit for bit those of
    :func:`kernels.append_kv.append_kv` given the returned key.

    Parameters
    ----------
    q : ``[B, Hq, D]``, k, v : ``[B, Hkv, D]`` on the device, one float dtype, unit stride on
        ``D`` (views of a fused qkv output are read in place); ``D`` even
    positions : int32/int64 ``[B]``
    rope : :class:`RopeParams` with ``inv_freq`` float32 ``[D / 2]`` contiguous on the device
    block_table, kv_pool, meta, kv_slots, page_table, slab_ids, write_pool, staging, fp8,
        pool_scale, slot_scale : as :func:`kernels.append_kv.append_kv`

    Returns
    -------
    ``(q_rot, k_rot)``: new contiguous ``[B, Hq, D]`` and ``[B, Hkv, D]``

    Raises
    ------
    ValueError : a shape, dtype, stride or device that does not match the above
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    check_tensor("positions", positions, 1, INDEX_DTYPES, unit_last=False)
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    check_tensor("kv_pool", kv_pool, 5, (*FLOAT_DTYPES, FP8) if fp8 else FLOAT_DTYPES)
    b, hq, d = q.shape
    hkv = k.shape[1]
    s = kv_pool.shape[3]
    require(d % 2 == 0, f"RoPE needs an even head dim, got {d}")
    require(hkv > 0 and hq % hkv == 0, f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    require(
        q.dtype == k.dtype == v.dtype, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    )
    check_shape("k", k, (b, hkv, d))
    check_shape("v", v, (b, hkv, d))
    check_shape("positions", positions, (b,))
    inv = rope.inv_freq
    require(
        inv.dtype == torch.float32 and inv.shape == (d // 2,) and inv.is_contiguous(),
        f"rope.inv_freq must be contiguous float32 [{d // 2}], got {inv.dtype} {tuple(inv.shape)}",
    )
    require(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, batch is {b}")
    require(
        kv_pool.shape[1:] == (hkv, 2, s, d),
        f"kv_pool must be [P_pool, {hkv}, 2, S, {d}], got {tuple(kv_pool.shape)}",
    )
    dev = q.device
    check_device(dev, k=k, v=v, positions=positions, block_table=block_table, inv_freq=inv)
    if meta is not None:
        check_tensor("meta", meta, 4, FLOAT_DTYPES)
        require(
            meta.shape[1:] == (hkv, 2, d),
            f"meta must be [P_pool, {hkv}, 2, {d}], got {tuple(meta.shape)}",
        )
        check_device(dev, meta=meta)
    if staging is not None:
        check_tensor("staging", staging, 4, FLOAT_DTYPES)
        check_shape("staging", staging, (b, hkv, 2, d))
        check_device(dev, staging=staging)
    write_scale, scale = check_pool_writes(kv_pool, pool_scale, write_pool, dev, k)
    has_slots = kv_slots is not None
    slots_fp8, slot_scale = check_slot_writes(
        kv_slots, page_table, slab_ids, slot_scale, fp8, (b, hkv, s, d), dev, k
    )
    if not has_slots:
        kv_slots, page_table, slab_ids = _unused(k, 4), block_table, positions.view(-1, 1)
    require_runnable(dev)
    q_out = torch.empty(b, hq, d, dtype=q.dtype, device=dev)
    k_out = torch.empty(b, hkv, d, dtype=k.dtype, device=dev)
    if b * hkv == 0:
        return q_out, k_out
    has_meta, has_staging = meta is not None, staging is not None
    meta = meta if has_meta else _unused(k, 4)
    staging = staging if has_staging else _unused(k, 4)
    pool = kv_pool if write_pool else _unused(k, 5)
    _rope_append_kernel[(b * hkv,)](
        q,
        k,
        v,
        q_out,
        k_out,
        positions,
        inv,
        block_table,
        pool,
        meta,
        kv_slots,
        page_table,
        slab_ids,
        staging,
        scale,
        slot_scale,
        hkv,
        1.0 / float(rope.position_divisor),
        float(rope.attention_factor),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        block_table.stride(0),
        pool.stride(0),
        pool.stride(1),
        pool.stride(2),
        pool.stride(3),
        meta.stride(0),
        meta.stride(1),
        meta.stride(2),
        kv_slots.stride(0),
        kv_slots.stride(1),
        kv_slots.stride(2),
        page_table.stride(0),
        slab_ids.stride(0),
        slab_ids.stride(1),
        staging.stride(0),
        staging.stride(1),
        staging.stride(2),
        scale.stride(0),
        scale.stride(1),
        scale.stride(2),
        slot_scale.stride(0),
        slot_scale.stride(1),
        GROUP=hq // hkv,
        HALF=d // 2,
        BLOCK_HALF=next_pow2(d // 2),
        PAGE_SIZE=s,
        LIBDEVICE=not interpreted(),
        HAS_SLOTS=has_slots,
        WRITE_POOL=write_pool,
        HAS_META=has_meta,
        HAS_STAGING=has_staging,
        FP8=fp8,
        POOL_FP8=write_scale,
        SLOTS_FP8=slots_fp8,
        num_warps=1,
    )
    return q_out, k_out
