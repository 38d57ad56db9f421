"""dcr's block FP8 quantizer (the scheme FP8 engines requantize with,
docs/layouts.md "FP8 engines") against an independent reference built on
torch: per 128 x 128 block, scale = amax / 448 in float32 over the finite
magnitudes (1 for a block without one), elements x / scale cast with torch's
float8_e4m3fn conversion (round to nearest even, subnormals kept). Every
BF16 bit pattern is covered, and edge blocks; bits are compared, not values.
"""

from __future__ import annotations

import pytest
import torch

import dcr
from dcr.errors import InvalidArgumentError


def reference(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style block quantization with torch's own casts."""
    f = x.float()
    rows, cols = f.shape
    sr, sc = (rows + block - 1) // block, (cols + block - 1) // block
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scales = torch.empty((sr, sc), dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            b = f[i * block:(i + 1) * block, j * block:(j + 1) * block]
            finite = b[torch.isfinite(b)].abs()
            amax = finite.max() if finite.numel() else torch.tensor(0.0)
            s = amax / torch.tensor(448.0) if amax > 0 else torch.tensor(1.0)
            scales[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (b / s).to(torch.float8_e4m3fn)
    return q, scales


def every_bf16_pattern_but_infinities() -> torch.Tensor:
    """All 65536 BF16 bit patterns except +-inf, shuffled into [217, 302]
    (edge blocks in both directions), with -0 and the largest finite kept."""
    g = torch.Generator().manual_seed(5)
    bits = torch.arange(0, 65536, dtype=torch.int32)
    bits = bits[(bits != 0x7F80) & (bits != 0xFF80)]
    bits = bits[torch.randperm(bits.numel(), generator=g)]
    return bits.to(torch.int16).view(torch.bfloat16).reshape(217, 302)


def fp8_bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def test_every_bf16_pattern_matches_torch_e4m3_casts():
    x = every_bf16_pattern_but_infinities()
    got_q, got_s = dcr.quantize_fp8_blocks(x)
    want_q, want_s = reference(x)
    assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32))
    # NaN stays NaN: torch writes 0x7F for every NaN, dcr keeps the sign (0xFF for a negative one).
    nan = torch.isnan(x.float())
    assert torch.equal(fp8_bits(got_q)[~nan], fp8_bits(want_q)[~nan])
    assert bool(((fp8_bits(got_q)[nan] & 0x7F) == 0x7F).all())


def test_realistic_weights_blocks_and_edges_match_torch():
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(300, 390, generator=g) * 0.02).to(torch.bfloat16)
    x[130:140, 0:50] = 0  # part of a block zero
    x[256:300, 384:390] = 0  # the corner edge block all zeros: scale 1
    x[3, 200] = 7.5  # one block's amax far above the rest
    x[200, 5] = -torch.finfo(torch.bfloat16).tiny / 4  # a BF16 subnormal
    for block in (128, 64):
        got_q, got_s = dcr.quantize_fp8_blocks(x, block=block)
        want_q, want_s = reference(x, block)
        assert got_s.shape == ((300 + block - 1) // block, (390 + block - 1) // block)
        assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32)), block
        assert torch.equal(fp8_bits(got_q), fp8_bits(want_q)), block
    assert float(dcr.quantize_fp8_blocks(x)[1][2, 3]) == 1.0
    # F32 input quantizes the same way.
    got_q, got_s = dcr.quantize_fp8_blocks(x.float())
    want_q, want_s = reference(x.float())
    assert torch.equal(fp8_bits(got_q), fp8_bits(want_q)) and torch.equal(got_s, want_s)


def test_infinities_saturate_as_torch_does_and_do_not_count_in_the_amax():
    x = torch.zeros(4, 4, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[1, 1] = float("inf"), float("-inf"), 2.0
    q, s = dcr.quantize_fp8_blocks(x)
    want_q, want_s = reference(x)
    assert float(s[0, 0]) == float(torch.tensor(2.0) / 448.0)
    assert int(fp8_bits(q)[0, 0]) == 0x7E and int(fp8_bits(q)[0, 1]) == 0xFE  # +-448
    assert torch.equal(fp8_bits(q), fp8_bits(want_q)) and torch.equal(s, want_s)


def test_bad_input_is_refused():
    with pytest.raises(InvalidArgumentError, match="2-D BF16 or F32"):
        dcr.quantize_fp8_blocks(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgumentError, match="2-D BF16 or F32"):
        dcr.quantize_fp8_blocks(torch.zeros(3, 3, dtype=torch.float16))
    with pytest.raises(InvalidArgumentError, match="not positive"):
        dcr.quantize_fp8_blocks(torch.zeros(3, 3), block=0)
