"""Independent NVFP4 reference: quantise, pack, dequantise (docs/BACKGROUND.md section 4).

NVFP4 stores a weight W [..., N, K] as
  * 4-bit E2M1 codes, two per byte, the EVEN element of each pair in the LOW nibble;
  * one FP8 E4M3 block scale s_b per 16 consecutive elements along K;
  * one fp32 global scale per tensor (per expert for MoE), stored as
    scale_2 = amax / 2688 = 1 / gs, where gs = 448 * 6 / amax quantises.

Quantise:   s_b  = e4m3(min(gs * blockamax / 6, 448))
            code = rne_even_code(clamp(x * gs / s_b, -6, 6))
Dequantise: x_hat = value(code) * s_b * scale_2

Written from the format description only (no code from torchao, vLLM, ...). Deliberate
choices where the format leaves room, all relied on by tests/test_nvfp4.py:
  * A non-zero block whose scale would round to E4M3 zero gets the smallest positive E4M3
    scale (2**-9) instead, so every non-zero block has a positive scale and keeps its
    values (kernels such as vLLM's write 0 there and lose the block).
  * An all-zero block gets s_b = 0 and codes 0. An all-zero tensor/expert (amax = 0) gets
    scale_2 = 0 (still amax / 2688), block scales 0 and codes 0, so every dequantisation
    path yields exact zeros. Callers must not invert scale_2 for such an expert.
  * Negative inputs keep the sign bit even when they round to zero (-0.1 -> code 8, "-0"),
    as a hardware round-to-nearest conversion does; -0.0 itself encodes as code 0.
  * Inputs are normalised per tensor by an exact power of two before scaling, so amax
    anywhere in the fp32 range (even 1e-40 or 3e38) neither overflows gs nor makes NaN; the
    codes and scales equal those of the literal fp32 formula whenever that formula does not
    overflow.
Kernels may order the scale arithmetic differently (e.g. gs * (blockamax * (1/6))), which
can move an exact E4M3/E2M1 rounding tie by one step: compare against them by value with
quantization_error_bound, not byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E4M3_MAX",
    "GLOBAL_RANGE",
    "E2M1_VALUES",
    "NVFP4Weight",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "quantize",
    "dequantize",
    "dequantize_into",
    "quantization_error_bound",
]

BLOCK_SIZE = 16  # elements along K sharing one E4M3 scale
E2M1_MAX = 6.0  # largest E2M1 magnitude
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
GLOBAL_RANGE = E4M3_MAX * E2M1_MAX  # 2688: gs maps amax onto the top of both grids
E4M3_MIN_SUBNORMAL = 2.0**-9  # smallest positive float8_e4m3fn
E4M3_MIN_NORMAL = 2.0**-6  # below this E4M3 is uniformly spaced by 2**-9
FP32_HALF_SUBNORMAL = 2.0**-150  # fp32's largest rounding error below 2**-126
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7

# Decision boundaries between consecutive magnitude codes c and c+1 (midpoints), with
# whether an exact tie moves up to c+1. Ties go to the EVEN code, so a tie moves up exactly
# when c is odd: 0.25->0, 0.75->1(code 2), 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_ENCODE_BOUNDARIES = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

# Default working-set cap for dequantize_into: bytes of one nibble plane per chunk. Peak
# temporaries are about 3x this in uint8 plus the chunk's block scales in out's dtype.
_DEFAULT_CHUNK_BYTES = 1 << 25


@dataclass
class NVFP4Weight:
    """A quantised weight. Leading dims "..." are e.g. the expert dim E.

    packed:      [..., N, K//2]  uint8, element 2i in the low nibble of byte i
    block_scale: [..., N, K//16] float8_e4m3fn
    scale_2:     [...]           float32, amax / 2688 (0-d for a plain 2-D weight)
    """

    packed: Tensor
    block_scale: Tensor
    scale_2: Tensor

    def __post_init__(self) -> None:
        _check_layout(self.packed, self.block_scale, "NVFP4Weight")
        if tuple(self.scale_2.shape) != tuple(self.packed.shape[:-2]):
            raise ValueError(
                f"NVFP4Weight: scale_2 must have the leading dims {tuple(self.packed.shape[:-2])} "
                f"of packed {tuple(self.packed.shape)}, got {tuple(self.scale_2.shape)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (unpacked) shape [..., N, K]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)


# ----------------------------------------------------------------------------- E2M1 codes


def e2m1_encode(x: Tensor) -> Tensor:
    """Round values already in code units to E2M1 codes 0..15 (uint8), same shape.

    Round to nearest, ties to the even code, saturating at +-6 (also for +-inf). Bit 3 is
    the sign of x (x < 0). NaN has no E2M1 encoding and becomes code 0.
    """
    magnitude = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    crossed = torch.empty(x.shape, dtype=torch.bool, device=x.device)  # reused buffer
    # The magnitude code is the number of decision boundaries |x| has crossed.
    for boundary, tie_moves_up in _ENCODE_BOUNDARIES:
        compare = torch.ge if tie_moves_up else torch.gt
        compare(magnitude, boundary, out=crossed)
        codes.add_(crossed)
    torch.lt(x, 0, out=crossed)
    return codes.add_(crossed, alpha=8)


def e2m1_decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode E2M1 codes (uint8, only the low 4 bits used) to values of `dtype`.

    Arithmetic from the bits, no lookup table: sign = bit 3, e = bits 2..1, m = bit 0;
    e == 0 is subnormal 0.5*m, otherwise 2**(e-1) * (1 + m/2). Every value is exact in
    fp16/bf16/fp32.
    """
    codes = codes.to(torch.uint8)
    negative = (codes & 8) != 0
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).to(dtype)
    # 2**(e-1) as an exact integer shift: (1 << e) / 2.
    power = torch.bitwise_left_shift(torch.ones_like(exponent), exponent).to(dtype) * 0.5
    normal = power * (1 + 0.5 * mantissa)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, normal)
    return torch.where(negative, -magnitude, magnitude)


def _decode_doubled_(nibbles: Tensor) -> tuple[Tensor, Tensor]:
    """(2 * |value(code)|, sign +1/-1), both int8, for uint8 codes 0..15, CONSUMING `nibbles`.

    Doubling makes every E2M1 value an integer (0,1,2,3,4,6,8,12), so the decode stays in
    1-byte temporaries: with e = (c>>1)&3, m = c&1 and k = max(e,1)-1,
    2*|value| = ((c&7) - 2k) << k  (significand m or 2+m, times 2**(e-1) for normals).
    The sign stays apart because an int8 has no -0: code 8 must decode to -0.0, so the
    caller applies it in floating point. Only elementwise kernels: safe inside capture.
    """
    shift = (nibbles >> 1).bitwise_and_(3).clamp_(min=1).sub_(1)  # k in {0,1,2}
    sign = (nibbles >> 3).view(torch.int8).mul_(-2).add_(1)  # +1 or -1
    doubled = nibbles.bitwise_and_(7).sub_(shift).sub_(shift).bitwise_left_shift_(shift)
    return doubled.view(torch.int8), sign


# ----------------------------------------------------------------------------- packing


def pack_fp4(codes: Tensor) -> Tensor:
    """[..., K] uint8 codes -> [..., K//2] uint8, element 2i in the LOW nibble of byte i."""
    if codes.dim() < 1 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim (two codes per byte), got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """[..., K//2] uint8 -> [..., K] uint8 codes 0..15 (inverse of pack_fp4)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- quantise


def quantize(w: Tensor, global_scale: float | Tensor | None = None) -> NVFP4Weight:
    """Quantise w [..., N, K] (bf16/fp16/fp32, any device) to NVFP4, per [N, K] slice.

    global_scale: the quant-direction gs (scalar or [...]). Default None derives it from
    the data, gs = 2688 / amax per slice (per expert for [E, N, K]), and stores
    scale_2 = amax / 2688. Passing it (e.g. 1.0 for the docs/BACKGROUND.md test vectors) uses
    the literal formula with that gs and stores scale_2 = 1 / gs; values beyond
    6 * 448 / gs then saturate and quantization_error_bound no longer applies.
    Not meant for CUDA-graph capture (it checks finiteness on the host).
    """
    _check_weight_shape(w)
    scratch = w.to(torch.float32, copy=True)  # [..., N, K], scaled in place below
    amax = _slice_amax(scratch)  # [...]
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"quantize: w of shape {tuple(w.shape)} contains NaN or Inf")
    if global_scale is None:
        scale_2 = _divide(amax, GLOBAL_RANGE)
        gs = _normalize_slices_(scratch, amax)
    else:
        gs = _as_global_scale(global_scale, w)
        scale_2 = _divide(1.0, gs)
    codes, block_scale = _quantize_blocks_(scratch, gs)
    return NVFP4Weight(pack_fp4(codes), block_scale, scale_2.contiguous())


def _check_weight_shape(w: Tensor) -> None:
    shape = tuple(w.shape)
    if w.dim() < 2:
        raise ValueError(
            f"quantize expects a weight of shape [..., N, K] (at least 2 dims), got shape "
            f"{shape}; reshape a vector to [1, K]"
        )
    if w.shape[-1] % BLOCK_SIZE or w.shape[-1] == 0 or w.shape[-2] == 0:
        padded = max(BLOCK_SIZE, -(-w.shape[-1] // BLOCK_SIZE) * BLOCK_SIZE)
        raise ValueError(
            f"quantize: NVFP4 needs the last dim K to be a positive multiple of {BLOCK_SIZE} "
            f"(one E4M3 scale per {BLOCK_SIZE} elements along K) and N > 0, got shape {shape}; "
            f"zero-pad K to {padded}"
        )
    if not w.is_floating_point():
        raise ValueError(f"quantize expects a floating-point weight, got {w.dtype}")


def _slice_amax(w: Tensor) -> Tensor:
    """max|w| over the last two dims: [..., N, K] -> [...], without an |w| temporary."""
    return torch.maximum(w.amax(dim=(-2, -1)), w.amin(dim=(-2, -1)).neg())


def _divide(numerator: Tensor | float, denominator: Tensor | float) -> Tensor:
    """Correctly rounded fp32 division, identical on CPU and CUDA.

    `t / 6.0` on CUDA multiplies by a rounded 1/6, and `2688 / t` is reciprocal-then-multiply
    on every device: both round twice and can move an exact E4M3/E2M1 tie. Dividing by a
    0-d tensor on the same device (made by a fill kernel, no host copy) divides exactly.
    """
    device = (numerator if isinstance(numerator, Tensor) else denominator).device
    return torch.div(_on_device(numerator, device), _on_device(denominator, device))


def _on_device(value: Tensor | float, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _pow2(exponent: Tensor) -> Tensor:
    """Exact 2**exponent (int tensor, -126..127) built from fp32 bits, no exp2 rounding."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _normalize_slices_(w: Tensor, amax: Tensor) -> Tensor:
    """Scale each slice of w [..., N, K] in place by 2**-p so its amax lies in [0.5, 1).

    Returns the matching gs [...] for the scaled data. Power-of-two scaling is exact, so
    x*gs and gs*blockamax are the same fp32 numbers as without it, except that nothing
    overflows when amax is tiny (gs = 2688/amax would be inf below ~8e-36) or huge.
    The shift is applied in two halves so each factor stays a normal fp32 (|p| <= 149).
    """
    exponent = torch.frexp(amax).exponent.neg()  # amax == 0 -> 0
    first = torch.div(exponent, 2, rounding_mode="floor")
    second = exponent - first
    for part in (first, second):
        w.mul_(_pow2(part)[..., None, None])
    amax_normalized = amax * _pow2(first) * _pow2(second)
    # An all-zero slice has no scale to find; any finite gs gives blockamax 0 -> s_b 0.
    safe = torch.where(amax_normalized > 0, amax_normalized, torch.ones_like(amax_normalized))
    return _divide(GLOBAL_RANGE, safe)


def _as_global_scale(global_scale: float | Tensor, w: Tensor) -> Tensor:
    lead = tuple(w.shape[:-2])
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device)
    try:
        gs = gs.expand(lead).clone()
    except RuntimeError as err:
        raise ValueError(
            f"quantize: global_scale of shape {tuple(gs.shape)} does not broadcast to the "
            f"leading dims {lead} of w {tuple(w.shape)}"
        ) from err
    if not bool(((gs > 0) & torch.isfinite(gs)).all()):
        raise ValueError("quantize: global_scale must be positive and finite")
    return gs


def _quantize_blocks_(w: Tensor, gs: Tensor) -> tuple[Tensor, Tensor]:
    """Codes [..., N, K] uint8 and block scales [..., N, K//16] e4m3 for fp32 w (CONSUMED).

    gs: [...] quant-direction global scale for each slice.
    """
    blocks = w.unflatten(-1, (-1, BLOCK_SIZE))  # [..., N, K/16, 16]
    block_amax = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg())  # [..., N, K/16]
    scale = _divide(gs[..., None, None] * block_amax, E2M1_MAX)
    # Lower clamp: a non-zero block must not get scale 0 (it would lose every value);
    # 2**-9 is the smallest positive E4M3. Upper clamp: 448 is the largest finite E4M3.
    scale = torch.where(block_amax > 0, scale.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX), torch.zeros_like(scale))
    block_scale = scale.to(torch.float8_e4m3fn)
    stored = block_scale.to(torch.float32)
    divisor = torch.where(stored > 0, stored, torch.ones_like(stored))  # zero block: 0/1
    blocks.mul_(gs[..., None, None, None]).div_(divisor[..., None])  # x * gs / s_b
    return e2m1_encode(w), block_scale


# ----------------------------------------------------------------------------- dequantise


def dequantize(q: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Reference dequantisation: [..., N, K] = value(code) * s_b * scale_2, computed in fp32.

    Straightforward and memory-hungry on purpose (full fp32 temporaries): the yardstick
    that dequantize_into is tested against.
    """
    values = e2m1_decode(unpack_fp4(q.packed), torch.float32)  # [..., N, K]
    blocks = values.unflatten(-1, (-1, BLOCK_SIZE))  # [..., N, K/16, 16]
    blocks = blocks * q.block_scale.to(torch.float32)[..., None]
    blocks = blocks * q.scale_2.to(torch.float32)[..., None, None, None]
    return blocks.flatten(-2).to(dtype)


def dequantize_into(
    out: Tensor, packed: Tensor, block_scale: Tensor, alpha: Tensor | float, *, chunk_bytes: int = _DEFAULT_CHUNK_BYTES
) -> Tensor:
    """Write value(code) * float(block_scale) * alpha[..., None, None] into out; return out.

    out:         [..., N, K] contiguous float (bf16/fp16/fp32)
    packed:      [..., N, K//2] uint8
    block_scale: [..., N, K//16] float8_e4m3fn (or any float dtype)
    alpha:       [...] (broadcastable to the leading dims) or a Python float; pass
                 q.scale_2 to reproduce dequantize, or scale_2 * input_scale etc.

    CUDA-graph safe: only elementwise kernels on views and fresh temporaries; no host
    sync, no data-dependent shape, no host-to-device copy, and the Python control flow
    depends on shapes only. value * s_b is exact in out's dtype (<= 6 significant bits,
    range 2**-10..2688), and the alpha multiply runs in fp32 before one rounding to out's
    dtype, so the result equals dequantize(q, out.dtype) bit for bit when alpha is scale_2.
    Memory: out is written in row chunks of `chunk_bytes` bytes of packed codes; the
    temporaries are ~3 uint8 planes of that size plus the chunk's scales in out's dtype
    (never a full-size fp32 copy).
    """
    rows, k = _check_dequantize_into_args(out, packed, block_scale, alpha)
    if out.numel() == 0:
        return out
    out_rows = out.view(rows, k)
    packed_rows = packed.reshape(rows, k // 2)
    scale_rows = block_scale.reshape(rows, k // BLOCK_SIZE)
    rows_per_chunk = max(1, chunk_bytes // (k // 2))
    for start in range(0, rows, rows_per_chunk):
        stop = min(start + rows_per_chunk, rows)
        _write_scaled_values(out_rows[start:stop], packed_rows[start:stop], scale_rows[start:stop])
    if isinstance(alpha, Tensor):
        out.mul_(alpha[..., None, None])
    else:
        out.mul_(alpha)
    return out


def _check_dequantize_into_args(
    out: Tensor, packed: Tensor, block_scale: Tensor, alpha: Tensor | float
) -> tuple[int, int]:
    """Shape/dtype checks from metadata only (no device reads); returns (rows, K)."""
    if out.dim() < 2 or not out.is_floating_point() or not out.is_contiguous():
        raise ValueError(
            f"dequantize_into: out must be a contiguous float tensor [..., N, K], got "
            f"shape {tuple(out.shape)} dtype {out.dtype} contiguous={out.is_contiguous()}"
        )
    k = out.shape[-1]
    if k % BLOCK_SIZE:
        raise ValueError(f"dequantize_into: K must be a multiple of {BLOCK_SIZE}, out has shape {tuple(out.shape)}")
    expected_packed = (*out.shape[:-1], k // 2)
    expected_scale = (*out.shape[:-1], k // BLOCK_SIZE)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != expected_packed:
        raise ValueError(
            f"dequantize_into: packed must be uint8 {expected_packed} for out "
            f"{tuple(out.shape)}, got {packed.dtype} {tuple(packed.shape)}"
        )
    if not block_scale.is_floating_point() or tuple(block_scale.shape) != expected_scale:
        raise ValueError(
            f"dequantize_into: block_scale must be float8_e4m3fn {expected_scale} for out "
            f"{tuple(out.shape)}, got {block_scale.dtype} {tuple(block_scale.shape)}"
        )
    if isinstance(alpha, Tensor):
        lead = tuple(out.shape[:-2])
        if not broadcasts_to(tuple(alpha.shape), lead):
            raise ValueError(
                f"dequantize_into: alpha of shape {tuple(alpha.shape)} must broadcast to "
                f"the leading dims {lead} of out {tuple(out.shape)}"
            )
    return (out.numel() // k if k else 0), k


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to exactly `target`. Not torch.broadcast_shapes: its first
    call imports torch._refs and sympy, seconds of a worker's start-up (measured on the H200)."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _write_scaled_values(out: Tensor, packed: Tensor, block_scale: Tensor) -> None:
    """out [r, K] = value(code) * s_b for one row chunk (alpha is applied by the caller).

    packed [r, K//2], block_scale [r, K//16]. Each packed byte i of a block feeds out
    elements 2i (low nibble) and 2i+1 (high nibble), so out is viewed as
    [r, K/16, 8, 2] and each nibble plane is written straight into its strided half.
    """
    r, k = out.shape
    half_scale = block_scale.to(out.dtype).mul_(0.5).unsqueeze(-1)  # s_b/2: [r, K/16, 1]
    out_pairs = out.view(r, k // BLOCK_SIZE, BLOCK_SIZE // 2, 2)
    packed_blocks = packed.reshape(r, k // BLOCK_SIZE, BLOCK_SIZE // 2)
    for position in (0, 1):
        # One nibble plane alive at a time; (2*value) * (s_b/2) is exact and the
        # int8 * float product is written straight into out.
        nibbles = packed_blocks & 0xF if position == 0 else packed_blocks >> 4
        doubled, sign = _decode_doubled_(nibbles)
        half = out_pairs[..., position]
        torch.mul(doubled, half_scale, out=half)
        half.mul_(sign)  # in float: +0.0 * -1 = -0.0 for code 8, as dequantize gives
        del nibbles, doubled, sign


# ----------------------------------------------------------------------------- error bound


def quantization_error_bound(q: NVFP4Weight) -> Tensor:
    """Per-element bound on |x - dequantize(q, float32)| for q = quantize(x): [..., N, K] fp32.

    Derivation. Let u = x*gs/s_b be x in code units and c = code(u); the error is
    |u - value(c)| * s_b / gs with s_b / gs = s_b * scale_2.
    (1) |u| <= 6: round-to-nearest errs by at most half the E2M1 step around the result.
        The codes that can win are value 0..1.5 from u in [0, 1.75] -> 0.25;
        value 2 from [1.75, 2.5] and 3 from [2.5, 3.5] -> 0.5; value 4 from [3.5, 5] -> 1.0;
        value 6 from [5, 6] -> 1.0. So at most 1.0 code unit, and only |value| >= 4 needs it.
    (2) |u| > 6 (saturation, result value 6): because s_b = rne(s) with s = gs*blockamax/6,
        |u| <= 6*s/s_b. For a normal E4M3 s_b (>= 2**-6, 3 mantissa bits) rounding down loses
        at most 1/16 relative, so |u| - 6 <= 0.375 < 1. In the subnormal range s_b = k*2**-9
        (k = 1..7) and s < (k + 1/2)*2**-9, so |u| - 6 < 3/k code units = 3*2**-9 / s_b:
        up to 3 code units for k = 1. (Non-zero blocks with s < 2**-9 are clamped UP to
        s_b = 2**-9 >= s, so they never saturate; the upper clamp at 448 only matters for
        a caller-chosen gs, for which this bound does not hold.)
    Hence bound = halfstep(|value|) * s_b * scale_2, where halfstep is 0.25 below 2, 0.5
    below 4, 1.0 at 4, and max(1, 3*2**-9/s_b) at 6 (> 1 only for s_b = 2**-9 or 2*2**-9,
    i.e. blocks ~1e-5 below the slice amax). All-zero blocks get bound 0 (they are exact).
    (3) fp32 below its normal range. For amax < 2688 * 2**-126 (~3.2e-35) scale_2 itself is
        an fp32 subnormal, and value * s_b * scale_2 (>= 2**-10 * scale_2) can be one for
        amax below ~3e-32;
        there fp32 rounds to a multiple of 2**-149, an ABSOLUTE error of up to 2**-150 per
        rounding, which no relative slack covers. Two such roundings reach the result:
        scale_2 vs amax/2688 (the error above is in units of s_b * amax/2688, and the result
        is |value| * s_b * scale_2) and the final product. So the bound adds
        ((halfstep + |value|) * s_b + 1) * 2**-150: at most 2688 * 2**-149 ~ 2.6e-42, so
        negligible wherever fp32 stays normal. The bound is summed in fp64 and rounded up
        to fp32 (its own fp32 rounding would otherwise eat these terms).
    Beyond that it holds up to fp32 rounding of normal numbers: scale_2 = amax/2688 differs
    from 1/gs and u is rounded, each by a relative ~1e-7, so compare with a relative slack of
    ~1e-5 (and no absolute slack).
    """
    magnitude = e2m1_decode(unpack_fp4(q.packed), torch.float32).abs()  # [..., N, K]
    scale = q.block_scale.to(torch.float32)  # [..., N, K/16]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    saturation = torch.where(scale < E4M3_MIN_NORMAL, 3 * E4M3_MIN_SUBNORMAL / safe, torch.full_like(scale, 0.375))
    top = torch.clamp(saturation, min=1.0)[..., None]  # [..., N, K/16, 1]
    blocks = magnitude.unflatten(-1, (-1, BLOCK_SIZE))
    half_step = torch.where(blocks < 2, 0.25, torch.where(blocks < 4, 0.5, 1.0))
    half_step = torch.where(blocks == E2M1_MAX, top, half_step)
    # In fp64: the (3) terms are below fp32's smallest subnormal (2**-149) for small |value| * s_b.
    scale_2 = q.scale_2.to(torch.float64)[..., None, None, None]
    step = half_step.double() * scale[..., None].double()  # halfstep * s_b
    scaled = blocks.double() * scale[..., None].double()  # |value| * s_b, exact
    bound = step * scale_2 + ((step + scaled) + 1) * FP32_HALF_SUBNORMAL
    bound = bound.flatten(-2)
    return _round_up_to_fp32(bound)


def _round_up_to_fp32(x: Tensor) -> Tensor:
    """fp64 -> the smallest fp32 >= x, so a bound stays a bound after the cast."""
    down = x.to(torch.float32)
    return torch.where(down.double() < x, torch.nextafter(down, torch.full_like(down, torch.inf)), down)


def _check_layout(packed: Tensor, block_scale: Tensor, who: str) -> None:
    if packed.dtype != torch.uint8 or packed.dim() < 2:
        raise ValueError(f"{who}: packed must be uint8 [..., N, K//2], got {packed.dtype} {tuple(packed.shape)}")
    k = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], k // BLOCK_SIZE)
    if k % BLOCK_SIZE or tuple(block_scale.shape) != expected:
        raise ValueError(
            f"{who}: block_scale must be {expected} for packed "
            f"{tuple(packed.shape)} (K = {k}, a multiple of {BLOCK_SIZE}), "
            f"got {tuple(block_scale.shape)}"
        )
