"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864), rotate-half layout
as in Hugging Face transformers, with the frequency scalings of ``RopeScaling``:

* ``llama3``: Llama 3.1's wavelength-banded scaling (transformers
  ``_compute_llama3_parameters``).
* ``linear``: position interpolation (Chen et al. 2023, arXiv:2306.15595): positions / factor.
* ``dynamic``: NTK-aware base change ``theta * factor ** (D / (D - 2))``, fixed for the
  configured maximum context (transformers' dynamic NTK recomputes it per length; a
  fixed base keeps one table for a whole batch).
* ``yarn``: YaRN (Peng et al. 2023, arXiv:2309.00071): NTK-by-parts interpolation with
  ramp between ``beta_fast`` and ``beta_slow`` and attention temperature
  ``0.1 * ln(factor) + 1`` folded into cos/sin.
* ``longrope``: LongRoPE (Ding et al. 2024, arXiv:2402.13753) as Phi-3/3.5 use it
  (transformers ``_compute_longrope_parameters``): each inverse frequency divided by its
  ``short_factor`` or ``long_factor`` entry, cos/sin multiplied by ``attention_factor``
  (default ``sqrt(1 + ln(factor) / ln(original))``, 1 when ``factor <= 1``). One table per
  run: the long factors when the run's ``context`` is above ``original_max_position``, as
  llama.cpp chooses them (its per-sequence context against ``n_ctx_orig``); transformers
  switches per forward pass on the current length instead, so the two agree whenever a
  run's sequences stay on one side of ``original_max_position``.

Frequency factors (GGUF ``rope_freqs.weight``, llama.cpp ``ggml_rope_ext``'s
``freq_factors``): each inverse frequency is divided by its factor before any scaling
above, as ggml's rope does (``theta / freq_factor``). llama.cpp's ``convert_hf_to_gguf.py``
stores Llama 3.1's ``llama3`` scaling this way: factor ``1`` for short wavelengths,
``factor`` for long ones and ``1 / ((1 - smooth) / factor + smooth)`` in between, which is
the ratio of the unscaled to transformers' ``llama3`` inverse frequencies.
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


class Rope:
    """Precomputed inverse frequencies; :meth:`cos_sin` for any positions.

    Parameters
    ----------
    head_dim : D; theta : base; scaling : optional :class:`RopeScaling`
    freq_factors : optional ``D / 2`` divisors of the inverse frequencies (GGUF
        ``rope_freqs.weight``; see the module docstring), applied before ``scaling``
    context : the run's context limit in tokens (picks ``longrope``'s long or short
        factors; ``None``: the short ones)

    Raises
    ------
    ValueError
        ``freq_factors`` (or a ``longrope`` factor list) of another length than ``D / 2``
        or with a value <= 0; an unknown scaling kind.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None = None,
        freq_factors: tuple[float, ...] | torch.Tensor | None = None,
        context: int | None = None,
    ):
        self.head_dim = head_dim
        self.context = context
        self.attention_factor = 1.0
        self.position_divisor = 1.0
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if freq_factors is not None:
            inv = inv / _factors("freq_factors", freq_factors, head_dim)
        if scaling is not None:
            inv = self._scale(inv, theta, scaling)
        self.inv_freq = inv.float()
        self._inv_on: dict[torch.device, torch.Tensor] = {}

    def _scale(self, inv: torch.Tensor, theta: float, sc: RopeScaling) -> torch.Tensor:
        d = self.head_dim
        if sc.kind == "linear":
            self.position_divisor = sc.factor
            return inv
        if sc.kind == "dynamic":
            base = theta * sc.factor ** (d / (d - 2))
            return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if sc.kind == "llama3":
            return _llama3(inv, sc)
        if sc.kind == "yarn":
            self.attention_factor = 0.1 * math.log(sc.factor) + 1.0 if sc.factor > 1 else 1.0
            return _yarn(inv, theta, d, sc)
        if sc.kind == "longrope":
            long = self.context is not None and self.context > sc.original_max_position
            name = "long_factor" if long else "short_factor"
            factors = getattr(sc, name)
            if factors is None:
                raise ValueError(f"longrope scaling without {name}")
            self.attention_factor = longrope_attention_factor(sc)
            return inv / _factors(name, factors, d)
        raise ValueError(f"unsupported rope scaling type {sc.kind!r}")

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, D]`` for int positions ``[T]`` (computed in float32)."""
        inv = self._inv_on.get(positions.device)
        if inv is None:  # one copy per device: no host->device copy per call (CUDA graphs)
            inv = self._inv_on[positions.device] = self.inv_freq.to(positions.device)
        ang = positions.float()[:, None] / self.position_divisor * inv[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (
            emb.sin() * self.attention_factor
        ).to(dtype)


def longrope_attention_factor(sc: RopeScaling) -> float:
    """cos/sin multiplier of ``longrope``: ``sc.attention_factor`` when given, else
    ``sqrt(1 + ln(factor) / ln(original_max_position))`` for ``factor > 1`` and 1
    otherwise (transformers ``_compute_longrope_parameters``; llama.cpp's converter writes
    the same value as ``rope.scaling.attn_factor``)."""
    if sc.attention_factor is not None:
        return float(sc.attention_factor)
    if sc.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(sc.factor) / math.log(sc.original_max_position))


def _factors(name: str, values, head_dim: int) -> torch.Tensor:
    ff = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if ff.numel() != head_dim // 2 or not bool((ff > 0).all()):
        raise ValueError(
            f"rope {name}: expected {head_dim // 2} positive values for "
            f"head_dim={head_dim}, got {ff.tolist()}"
        )
    return ff


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` with ``cos, sin [T, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def _llama3(inv: torch.Tensor, sc: RopeScaling) -> torch.Tensor:
    low_wavelen = sc.original_max_position / sc.low_freq_factor
    high_wavelen = sc.original_max_position / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    mid = (1 - smooth) * scaled / sc.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn(inv: torch.Tensor, theta: float, d: int, sc: RopeScaling) -> torch.Tensor:
    def dim_for(rotations: float) -> float:
        return (d * math.log(sc.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low = max(math.floor(dim_for(sc.beta_fast)), 0)
    high = min(math.ceil(dim_for(sc.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = inv / sc.factor
    return interpolated * (1 - extrapolation) + inv * extrapolation
