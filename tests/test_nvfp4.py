"""Tests for repro.scenarios.nvfp4, the independent NVFP4 reference (docs/BACKGROUND.md section 4)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repro.scenarios.nvfp4 import (
    NVFP4Weight,
    dequantize,
    dequantize_into,
    e2m1_decode,
    e2m1_encode,
    pack_fp4,
    quantization_error_bound,
    quantize,
    unpack_fp4,
)

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
VECTOR = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
VECTOR_BYTES = [0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE]
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
SETTINGS = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def scalar_reference_code(x: float) -> int:
    """Slow, obviously-correct E2M1 rounding: nearest magnitude, ties to the even code."""
    if math.isnan(x):
        return 0
    sign = 8 if x < 0 else 0
    clamped = min(abs(x), 6.0)
    best = min(range(8), key=lambda code: (abs(clamped - MAGNITUDES[code]), code % 2))
    return sign | best


def bytes_of(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).tolist()


def e4m3_byte(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).reshape(-1).tolist()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor: torch.equal on these also sees -0.0 vs +0.0."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_within_bound(w: torch.Tensor, q: NVFP4Weight) -> None:
    x = w.to(torch.float32)
    err = (x - dequantize(q, torch.float32)).abs()
    bound = quantization_error_bound(q)
    slack = 1e-5 * (bound + x.abs())  # fp32 rounding of normal numbers; no absolute slack
    excess = err - bound - slack
    assert bool((excess <= 0).all()), f"error exceeds bound by up to {excess.max().item():.3g}"


# ----------------------------------------------------------------------------- E2M1 codes


def test_decode_all_sixteen_codes():
    values = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    expected = list(MAGNITUDES) + [-m for m in MAGNITUDES]
    assert values.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_dtype_is_exact(dtype):
    values = e2m1_decode(torch.arange(16, dtype=torch.uint8), dtype)
    assert values.dtype == dtype
    assert values.float().tolist() == e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()


def test_encode_exact_values_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    # Code 8 is "-0": decoding gives -0.0, which encodes back to +0 (code 0).
    expected = [0 if c == 8 else c for c in range(16)]
    assert e2m1_encode(e2m1_decode(codes)).tolist() == expected


@pytest.mark.parametrize("tie,value", TIES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_encode_rounds_ties_to_even_code(tie, value, sign):
    code = e2m1_encode(torch.tensor([sign * tie]))
    assert e2m1_decode(code).item() == sign * value
    assert int(code) & 1 == 0  # every tie lands on an even magnitude code


def test_encode_saturates_and_keeps_sign():
    x = torch.tensor([6.0, 7.0, 1e30, math.inf, -7.0, -math.inf, -0.1, -0.0, math.nan])
    assert e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15, 8, 0, 0]


def test_encode_matches_scalar_reference_on_random_and_ties():
    rng = random.Random(1234)
    ties = [m for t, _ in TIES for m in (t, -t)]
    grid = [m * s for m in MAGNITUDES for s in (1, -1)]
    near = [t + d for t in ties for d in (-1e-6, 1e-6)]
    values = ties + grid + near + [rng.uniform(-8, 8) for _ in range(2000)]
    x = torch.tensor(values, dtype=torch.float32)
    expected = [scalar_reference_code(v) for v in x.tolist()]
    assert e2m1_encode(x).tolist() == expected
    assert e2m1_encode(x.to(torch.bfloat16)).tolist() == [
        scalar_reference_code(v) for v in x.to(torch.bfloat16).float().tolist()
    ]


@SETTINGS
@given(
    st.lists(
        st.one_of(
            st.floats(min_value=-8, max_value=8, width=32),
            st.sampled_from([t * s for t, _ in TIES for s in (1, -1)]),
        ),
        min_size=1,
        max_size=64,
    )
)
def test_encode_matches_scalar_reference_property(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert e2m1_encode(x).tolist() == [scalar_reference_code(v) for v in x.tolist()]


# ----------------------------------------------------------------------------- packing


def test_pack_puts_even_element_in_low_nibble():
    assert pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]


def test_vector_packs_to_background_bytes():
    codes = e2m1_encode(torch.tensor(VECTOR, dtype=torch.float32))
    packed = pack_fp4(codes)
    assert bytes_of(packed) == VECTOR_BYTES
    assert torch.equal(unpack_fp4(packed), codes)


def test_unpack_inverts_pack_for_all_bytes():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128)
    assert torch.equal(pack_fp4(unpack_fp4(packed)), packed)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------- test vectors


@pytest.mark.parametrize("factor,scale_byte", [(1.0, 0x38), (2.0, 0x40)])
def test_background_vector_with_unit_global_scale(factor, scale_byte):
    w = torch.tensor([VECTOR], dtype=torch.float32) * factor
    q = quantize(w, global_scale=1.0)
    assert bytes_of(q.packed) == VECTOR_BYTES
    assert e4m3_byte(q.block_scale) == [scale_byte]
    assert q.block_scale.float().item() == factor
    assert q.scale_2.item() == 1.0 and q.scale_2.shape == ()
    assert torch.equal(dequantize(q, torch.float32), w)
    assert torch.equal(dequantize(q), w.to(torch.bfloat16))


def test_ties_through_quantize():
    ties = [t for t, _ in TIES]
    row = [6.0] + ties + [-t for t in ties] + [0.0]
    expected = [6.0] + [v for _, v in TIES] + [-v for _, v in TIES] + [0.0]
    q = quantize(torch.tensor([row]), global_scale=1.0)
    assert q.block_scale.float().item() == 1.0
    assert dequantize(q, torch.float32)[0].tolist() == expected


def test_global_scale_per_expert_broadcasts():
    w = torch.tensor([VECTOR, VECTOR], dtype=torch.float32).reshape(2, 1, 16)
    q = quantize(w, global_scale=torch.tensor([1.0, 0.5]))
    assert q.scale_2.tolist() == [1.0, 2.0]
    assert e4m3_byte(q.block_scale) == [0x38, 0x30]  # 1.0 and 0.5
    assert torch.equal(dequantize(q, torch.float32), w)


# ----------------------------------------------------------------------------- properties


@st.composite
def weights(draw):
    lead = draw(st.sampled_from([(), (1,), (3,)]))
    n = draw(st.integers(1, 4))
    k = 16 * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    exponent = draw(st.integers(-3, 3) if dtype == torch.float16 else st.integers(-30, 30))
    # fp16 overflows at 65504: keep its data narrow.
    kinds = ["normal", "uniform"] + ([] if dtype == torch.float16 else ["wide"])
    shape_kind = draw(st.sampled_from(kinds))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(*lead, n, k, generator=gen)
    if shape_kind == "uniform":
        w = torch.rand(*lead, n, k, generator=gen) * 2 - 1
    elif shape_kind == "wide":  # ~8 decades: exercises subnormal E4M3 block scales
        w = w * torch.exp(torch.randn(*lead, n, k // 16, 1, generator=gen) * 4).repeat_interleave(16, dim=-1).reshape(
            *lead, n, k
        )
    zero_blocks = torch.rand(*lead, n, k // 16, generator=gen) < 0.2
    w = w.masked_fill(zero_blocks.repeat_interleave(16, dim=-1), 0.0)
    return (w * 10.0**exponent).to(dtype)


@SETTINGS
@given(weights())
def test_dequantized_error_within_bound(w):
    q = quantize(w)
    assert_within_bound(w, q)
    scale = q.block_scale.float()
    normal = scale >= 2.0**-6
    unit = (scale * q.scale_2[..., None, None]).repeat_interleave(16, dim=-1)
    # Where the block scale is a normal E4M3 the bound is at most 1.0 code unit.
    bound = quantization_error_bound(q)
    assert bool((bound <= unit * (1 + 1e-6))[normal.repeat_interleave(16, dim=-1)].all())


@SETTINGS
@given(weights())
def test_scales_follow_the_format(w):
    q = quantize(w)
    amax = w.float().abs().amax(dim=(-2, -1))
    assert torch.equal(q.scale_2, amax / 2688)
    scale = q.block_scale.float()
    block_amax = w.float().abs().unflatten(-1, (-1, 16)).amax(-1)
    assert bool(torch.isfinite(scale).all()) and bool((scale <= 448).all())
    assert bool((scale[block_amax > 0] > 0).all())
    assert bool((scale[block_amax == 0] == 0).all())
    codes = unpack_fp4(q.packed).unflatten(-1, (-1, 16))
    assert bool((codes[block_amax == 0] == 0).all())


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def literal_reference(w: torch.Tensor) -> tuple[list[int], list[int], float]:
    """The section-4 formula element by element in fp32 0-d tensors (slow, small w [N, K])."""
    amax = f32(max(abs(v) for v in w.reshape(-1).tolist()))
    gs = f32(2688.0) / amax
    codes, scale_bytes = [], []
    for row in w.tolist():
        for start in range(0, len(row), 16):
            block = row[start : start + 16]
            s = torch.clamp(gs * f32(max(abs(v) for v in block)) / f32(6.0), max=448.0)
            s_b = s.to(torch.float8_e4m3fn)
            scale_bytes.append(int(s_b.view(torch.uint8)))
            codes += [scalar_reference_code(float(f32(v) * gs / s_b.float())) for v in block]
    return codes, scale_bytes, float(amax / f32(2688.0))


@pytest.mark.parametrize("seed", range(4))
def test_quantize_matches_literal_fp32_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    w = (
        torch.randn(3, 32, generator=gen)
        * torch.exp(torch.randn(3, 2, generator=gen)).repeat_interleave(16, dim=-1)
        * 10.0 ** (seed - 2)
    )
    codes, scale_bytes, scale_2 = literal_reference(w)
    q = quantize(w)
    assert unpack_fp4(q.packed).reshape(-1).tolist() == codes
    assert e4m3_byte(q.block_scale) == scale_bytes
    assert q.scale_2.item() == scale_2


def test_scale_2_formula_example():
    w = torch.zeros(2, 16)
    w[1, 3] = -5.376
    q = quantize(w)
    assert q.scale_2.item() == pytest.approx(5.376 / 2688, rel=1e-7)
    assert q.block_scale.float()[1, 0].item() == 448.0  # the amax block uses the top
    assert dequantize(q, torch.float32)[1, 3].item() == pytest.approx(-5.376, rel=1e-6)


def test_all_zero_blocks_dequantize_to_exact_zeros():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[:, 16:32] = 0.0
    w[2, :] = 0.0
    q = quantize(w)
    out = dequantize(q, torch.float32)
    assert not bool(torch.isnan(out).any())
    assert bool((out[:, 16:32] == 0).all()) and bool((out[2] == 0).all())
    assert bool((q.block_scale.float()[:, 1] == 0).all())


@pytest.mark.parametrize("shape", [(8, 32), (3, 4, 32)])
def test_all_zero_tensor_gives_zero_scale_2_and_zeros(shape):
    q = quantize(torch.zeros(shape))
    assert bool((q.scale_2 == 0).all()) and q.scale_2.shape == shape[:-2]
    assert bool((q.block_scale.float() == 0).all()) and bool((q.packed == 0).all())
    assert torch.equal(dequantize(q, torch.float32), torch.zeros(shape))
    out = torch.full(shape, math.nan, dtype=torch.bfloat16)
    dequantize_into(out, q.packed, q.block_scale, q.scale_2)
    assert torch.equal(out, torch.zeros(shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("magnitude", [1e30, 1e-30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_and_tiny_amax(magnitude, dtype):
    w = (torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(1)) * magnitude).to(dtype)
    q = quantize(w)
    assert bool(torch.isfinite(q.scale_2).all()) and bool((q.scale_2 > 0).all())
    out = dequantize(q, torch.float32)
    assert bool(torch.isfinite(out).all())
    assert_within_bound(w, q)
    assert bool(torch.isfinite(dequantize(q)).all())


@pytest.mark.parametrize("magnitude", [1e-40, 1e-36, 1e-44])
@pytest.mark.parametrize("seed", [44, 0, 7])
def test_bound_holds_where_scale_2_is_an_fp32_subnormal(magnitude, seed):
    # amax below ~3.2e-35 makes scale_2 = amax / 2688 an fp32 subnormal: fp32 then rounds
    # by an absolute 2**-150, which the bound must carry (no absolute slack in the check).
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)) * magnitude
    q = quantize(w)
    assert q.scale_2.item() < 2.0**-126
    assert_within_bound(w, q)


def test_codes_and_scales_invariant_under_power_of_two_scaling():
    gen = torch.Generator().manual_seed(2)
    # Magnitudes in [0.5, 4] stay normal fp32 for every shift below, so scaling is exact.
    w = (torch.rand(2, 3, 32, generator=gen) * 3.5 + 0.5) * torch.randn(2, 3, 32, generator=gen).sign()
    w[0, 1, :16] = 0.0
    base = quantize(w)
    # At 2**-125, gs = 2688/amax would overflow fp32 without the exact normalisation.
    for shift in (-125, -100, -60, -1, 1, 60, 100, 125):
        q = quantize(torch.ldexp(w, torch.tensor(shift)))
        assert torch.equal(q.packed, base.packed), shift
        assert torch.equal(q.block_scale.view(torch.uint8), base.block_scale.view(torch.uint8)), shift
        assert bool(torch.isfinite(q.scale_2).all()) and bool((q.scale_2 > 0).all()), shift
        assert bool(torch.isfinite(dequantize(q, torch.float32)).all()), shift


def test_subnormal_block_scale_saturation_is_covered_by_bound():
    # amax 1 -> gs 2688. A block with blockamax b gets s = 448*b; choose s = 1.45 * 2**-9,
    # which rounds DOWN to the smallest E4M3 2**-9, so its top element saturates at
    # u = 6*1.45 = 8.7 code units: 2.7 code units of error, more than the 1.0 of normal
    # scales, yet within the derived 3*2**-9/s_b = 3 code units.
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0
    w[0, 16] = 1.45 * 2.0**-9 / 448
    q = quantize(w)
    assert q.block_scale.float()[0, 1].item() == 2.0**-9
    unit = 2.0**-9 * q.scale_2.item()
    err = (w - dequantize(q, torch.float32)).abs()[0, 16].item()
    assert 2.5 * unit < err <= quantization_error_bound(q)[0, 16].item() * (1 + 1e-5)
    assert quantization_error_bound(q)[0, 16].item() == pytest.approx(3 * unit)


def test_tiny_nonzero_block_keeps_positive_scale():
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0
    w[0, 16] = 1e-9  # s = 448e-9 would round to E4M3 zero
    q = quantize(w)
    assert q.block_scale.float()[0, 1].item() == 2.0**-9
    assert_within_bound(w, q)


def test_quantize_per_expert():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 8, 48, generator=gen) * torch.tensor([1e-3, 1.0, 1e3, 0.0])[:, None, None]
    q = quantize(w)
    assert q.scale_2.shape == (4,) and q.block_scale.shape == (4, 8, 3) and q.packed.shape == (4, 8, 24)
    assert torch.equal(q.scale_2, w.abs().amax(dim=(-2, -1)) / 2688)
    assert q.scale_2[3].item() == 0.0
    for e in range(4):
        alone = quantize(w[e])
        assert torch.equal(q.packed[e], alone.packed)
        assert torch.equal(q.block_scale[e].view(torch.uint8), alone.block_scale.view(torch.uint8))
        assert torch.equal(q.scale_2[e], alone.scale_2)
    assert_within_bound(w, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_accepts_dtypes_and_leaves_input_alone(dtype):
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    before = w.clone()
    q = quantize(w)
    assert torch.equal(w, before)
    assert q.packed.dtype == torch.uint8 and q.block_scale.dtype == torch.float8_e4m3fn
    assert q.scale_2.dtype == torch.float32
    assert dequantize(q).dtype == torch.bfloat16 and dequantize(q).shape == (4, 32)
    assert_within_bound(w, q)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("shape", [(4, 20), (2, 3, 8), (4, 0)])
def test_k_not_multiple_of_16_names_shape(shape):
    with pytest.raises(ValueError, match=r"multiple of 16") as info:
        quantize(torch.ones(shape))
    assert str(shape) in str(info.value) and "pad" in str(info.value)


def test_fewer_than_two_dims_names_shape():
    with pytest.raises(ValueError, match=r"\(16,\)") as info:
        quantize(torch.ones(16))
    assert "[1, K]" in str(info.value)


def test_non_finite_input_rejected():
    w = torch.ones(2, 16)
    w[1, 5] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(w)


def test_dequantize_into_rejects_mismatched_shapes():
    q = quantize(torch.randn(2, 4, 32))
    with pytest.raises(ValueError, match="packed"):
        dequantize_into(torch.empty(2, 4, 64), q.packed, q.block_scale, q.scale_2)
    with pytest.raises(ValueError, match="alpha"):
        dequantize_into(torch.empty(2, 4, 32), q.packed, q.block_scale, torch.ones(3))


# ----------------------------------------------------------------------------- dequantize_into


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16, 64), (3, 8, 48)])
@pytest.mark.parametrize("chunk_bytes", [8, 100, 1 << 25])
def test_dequantize_into_matches_dequantize(dtype, shape, chunk_bytes):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen))
    w[..., :16] = 0.0 if len(shape) == 2 else w[..., :16]
    q = quantize(w)
    out = torch.full(shape, math.nan, dtype=dtype)  # stale contents must not leak
    result = dequantize_into(out, q.packed, q.block_scale, q.scale_2, chunk_bytes=chunk_bytes)
    assert result is out
    assert torch.equal(bits(out), bits(dequantize(q, dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_into_keeps_the_sign_of_negative_zero(dtype):
    # -0.1 next to 6.0 rounds to code 8 ("-0"); dequantize gives -0.0 there, bit for bit.
    w = torch.zeros(2, 32)
    w[:, 0], w[:, 1], w[0, 17] = 6.0, -0.1, 6.0
    w[1, 17] = -0.1
    q = quantize(w)
    assert unpack_fp4(q.packed)[:, 1].tolist() == [8, 8]
    reference = dequantize(q, dtype)
    assert bool(torch.signbit(reference[:, 1]).all())
    out = dequantize_into(torch.empty(2, 32, dtype=dtype), q.packed, q.block_scale, q.scale_2)
    assert torch.equal(bits(out), bits(reference))


def test_dequantize_into_decodes_every_byte():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    scale = torch.ones(16, 2).to(torch.float8_e4m3fn)
    out = dequantize_into(torch.empty(16, 32), packed, scale, torch.tensor(1.0))
    table = list(MAGNITUDES) + [-m for m in MAGNITUDES]
    expected = [table[b & 0xF] if i % 2 == 0 else table[b >> 4] for b in range(256) for i in range(2)]
    assert out.reshape(-1).tolist() == expected
    assert torch.signbit(out).reshape(-1).tolist() == [math.copysign(1.0, v) < 0 for v in expected]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_into_applies_alpha_after_block_scale(dtype):
    gen = torch.Generator().manual_seed(6)
    q = quantize(torch.randn(3, 4, 32, generator=gen))
    alpha = q.scale_2 * torch.tensor([3.7, 0.01, 250.0])
    values = e2m1_decode(unpack_fp4(q.packed)).unflatten(-1, (-1, 16))
    expected = (values * q.block_scale.float()[..., None] * alpha[:, None, None, None]).flatten(-2)
    out = dequantize_into(torch.empty(3, 4, 32, dtype=dtype), q.packed, q.block_scale, alpha)
    assert torch.equal(out, expected.to(dtype))


def test_dequantize_into_has_no_data_dependent_host_work():
    # Meta tensors carry no data: any .item(), .tolist(), nonzero or value-dependent branch
    # would raise here, which is what would break (or sync) a CUDA-graph capture.
    out = torch.empty(4, 64, 128, dtype=torch.bfloat16, device="meta")
    packed = torch.empty(4, 64, 64, dtype=torch.uint8, device="meta")
    scale = torch.empty(4, 64, 8, dtype=torch.float8_e4m3fn, device="meta")
    alpha = torch.empty(4, device="meta")
    assert dequantize_into(out, packed, scale, alpha, chunk_bytes=1024) is out


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
def test_dequantize_into_captures_in_cuda_graph():
    device = torch.device("cuda")
    w = torch.randn(8, 256, 512, device=device, dtype=torch.bfloat16)
    q = quantize(w)
    cpu = quantize(w.cpu())  # same fp32 operations, so bit-identical across devices
    assert torch.equal(q.scale_2.cpu(), cpu.scale_2)
    assert torch.equal(q.block_scale.view(torch.uint8).cpu(), cpu.block_scale.view(torch.uint8))
    assert torch.equal(q.packed.cpu(), cpu.packed)
    out = torch.empty(8, 256, 512, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dequantize_into(out, q.packed, q.block_scale, q.scale_2, chunk_bytes=1 << 18)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            dequantize_into(out, q.packed, q.block_scale, q.scale_2, chunk_bytes=1 << 18)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dequantize(q))


@pytest.mark.gpu
def test_dequantize_into_real_shape_memory():
    device = torch.device("cuda")
    e, n, k = 128, 1536, 2048
    packed = torch.randint(0, 256, (e, n, k // 2), device=device, dtype=torch.uint8)
    scale = torch.rand(e, n, k // 16, device=device).mul(448).to(torch.float8_e4m3fn)
    alpha = torch.rand(e, device=device)
    out = torch.empty(e, n, k, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dequantize_into(out, packed, scale, alpha)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < out.numel() * out.element_size() // 4, extra
    q = NVFP4Weight(packed[:2], scale[:2], alpha[:2])
    assert torch.equal(out[:2], dequantize(q))


@pytest.mark.parametrize(
    "shape, target",
    [
        ((), (4, 3)),
        ((3,), (4, 3)),
        ((1, 3), (4, 3)),
        ((4, 1), (4, 3)),
        ((4, 3), (4, 3)),
        ((2,), (4, 3)),
        ((5, 4, 3), (4, 3)),
        ((4, 3), (3,)),
        ((1,), ()),
        ((), ()),
    ],
)
def test_broadcasts_to_agrees_with_torch(shape, target):
    from repro.scenarios.nvfp4 import broadcasts_to

    try:
        expected = torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        expected = False
    assert broadcasts_to(shape, target) == expected
