"""Philox4x32-10 known answers (Random123 kat_vectors) and the element layout of z."""

import pytest
import torch

from probe_kernels.dist import GAUSS8_TABLE
from probe_kernels.philox import check_seed, philox4x32_10, randint4x
from probe_kernels.reference import direction_codes, direction_ref


def _t(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int64)


@pytest.mark.parametrize(
    "ctr,key,expect",
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox4x32_10_known_answers(ctr, key, expect):
    out = philox4x32_10(*[_t(c) for c in ctr], *key)
    assert tuple(int(o) for o in out) == expect


def test_randint4x_maps_seed_and_counter_like_triton():
    # tl.randint4x: key = (seed lo, seed hi), counter = (offset lo, offset hi, 0, 0)
    seed, c = 0x299F31D0A4093822, 0x05A308D3243F6A88
    got = randint4x(seed, _t(c))[0].tolist()
    ref = philox4x32_10(_t(c & 0xFFFFFFFF), _t(c >> 32), _t(0), _t(0), seed & 0xFFFFFFFF, seed >> 32)
    assert got == [int(r) for r in ref]


def test_gauss8_layout_bytes_little_endian_by_word():
    seed = (1 << 33) + 11
    words = randint4x(seed, torch.arange(0, 4, dtype=torch.int64))
    codes = direction_codes(seed, 0, 64, "gauss8").tolist()
    for i in range(64):
        c, b = divmod(i, 16)
        assert codes[i] == (int(words[c, b // 4]) >> (8 * (b % 4))) & 0xFF
    z = direction_ref(seed, 0, 64, "gauss8")
    assert torch.equal(z, torch.from_numpy(GAUSS8_TABLE.copy())[torch.tensor(codes)])


def test_rademacher_layout_bits_lsb_first_by_word():
    seed = 42
    words = randint4x(seed, torch.arange(0, 3, dtype=torch.int64))
    z = direction_ref(seed, 0, 384, "rademacher").tolist()
    for i in range(384):
        c, j = divmod(i, 128)
        bit = (int(words[c, j // 32]) >> (j % 32)) & 1
        assert z[i] == (-1.0 if bit else 1.0)


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1 << 64, ValueError), (1.5, TypeError), (True, TypeError)])
def test_seed_validation(bad, exc):
    with pytest.raises(exc):
        check_seed(bad)
