"""The reference encode/decode (bf16opt/storage.py) against numpy, over dense bit patterns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bf16opt.storage import decode, encode
from oracles import bits, encode_bits


def interesting_floats() -> np.ndarray:
    """Random fp32 bit patterns plus every kind of edge: ties, subnormals, overflow, inf, NaN."""
    rng = np.random.default_rng(0)
    patterns = [rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)]
    upper = rng.integers(0, 2 ** 16, 20_000, dtype=np.uint64).astype(np.uint32) << 16
    for low in (0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF):  # bf16 ties and near-ties
        patterns.append(upper | low)
    # float16 ties and near-ties: 13 low bits at the halfway point, across the exponent range
    f16_upper = rng.integers(0, 2 ** 19, 20_000, dtype=np.uint64).astype(np.uint32) << 13
    for low in (0x0FFF, 0x1000, 0x1001):
        patterns.append(f16_upper | low)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65520.0, 65519.99,
                         6.0e-8, 2.98e-8, 1e-45, -1e-45, 3.4028235e38, 1.1754942e-38, 9.2e-41],
                        dtype=np.float32).view(np.uint32)
    nan_payloads = np.array([0x7F800001, 0xFF800001, 0x7FBFFFFF, 0xFFC00000, 0x7FFFFFFF], dtype=np.uint32)
    return np.concatenate(patterns + [specials, nan_payloads]).view(np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encode_is_round_to_nearest_even_with_canonical_nan(dtype):
    values = interesting_floats()
    encoded = encode(torch.from_numpy(values.copy()), dtype)
    assert encoded.dtype == dtype
    np.testing.assert_array_equal(bits(encoded), encode_bits(values, dtype))


def test_canonical_nan_bits():
    nans = torch.tensor([0x7F800001, 0xFFC00000, 0x7FFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert set(bits(encode(nans, torch.bfloat16)).tolist()) == {0x7FC0}
    assert set(bits(encode(nans, torch.float16)).tolist()) == {0x7E00}
    assert set(bits(encode(nans, torch.float32)).tolist()) == {0x7FC00000}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_is_exact_for_every_16_bit_pattern(dtype):
    patterns = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    values = patterns.view(dtype)
    decoded = decode(values).numpy()
    if dtype == torch.float16:
        expected = patterns.numpy().view(np.float16).astype(np.float32)
    else:
        expected = (patterns.numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(decoded.view(np.uint32)[finite], expected.view(np.uint32)[finite])
    assert np.all(np.isnan(decoded[~finite]))
    # decoding then encoding gives back every non-NaN pattern
    round_trip = bits(encode(decode(values), dtype))
    np.testing.assert_array_equal(round_trip[finite], patterns.numpy().view(np.uint16)[finite])


def test_param_name_stream_ids_are_pinned():
    """A named param's stream id (docs/numerics.md): BLAKE2b with a 4-byte digest of the UTF-8
    name, read little-endian.  Pinned values: a change would change every named run's bits and
    break resumed checkpoints."""
    import hashlib

    from bf16opt.storage import name_id, stream_id

    assert name_id("0.weight") == 0x42C28E7E
    assert name_id("encoder.layers.0.attn.q_proj.weight") == 0x2FCC98AB
    assert name_id("poids.é") == int.from_bytes(hashlib.blake2b("poids.é".encode(), digest_size=4).digest(),
                                                "little")
    assert stream_id(3, None) == 3 and stream_id(3, "0.weight") == 0x42C28E7E
