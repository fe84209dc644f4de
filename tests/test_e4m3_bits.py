"""The bit-field constructions of bf16 and f16 from e4m3 that benchmarks/cvt_probe.cu times against
the conversion instruction (``benchmarks/e4m3_bits.h``), run on the host for every byte with the
byte permute emulated (so its selectors are checked too): each finite e4m3 value comes out as
the bf16 of that value times 2^-120 and the f16 of it times 2^-8 (subnormals included), from
either byte pair of a word, with other bytes around it; NaN bytes come out as the documented
finite 480 times those powers of two."""

from __future__ import annotations

import os
import shutil
import subprocess

import ml_dtypes
import numpy as np

from conftest import skip_or_fail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = r"""
#include <cstdio>
#include "benchmarks/e4m3_bits.h"
int main() {
  for (unsigned b = 0; b < 256; ++b) {
    const unsigned other = (b * 37u + 11u) & 0xFFu;
    const unsigned low = E4m3x2ToBf16x2TimesTwoToMinus120(b | other << 8 | 0xA5A50000u, 0);
    const unsigned high = E4m3x2ToBf16x2TimesTwoToMinus120(0x5A5Au | b << 16 | other << 24, 1);
    const unsigned low16 = E4m3x2ToF16x2TimesTwoToMinus8(b | other << 8 | 0xA5A50000u, 0);
    const unsigned high16 = E4m3x2ToF16x2TimesTwoToMinus8(0x5A5Au | b << 16 | other << 24, 1);
    std::printf("%u %u %u %u %u\n", b, low, high, low16, high16);
  }
}
"""


def expected_bits(byte: int, dtype, exponent: int) -> int:
    """The bits of e4m3 byte `byte` times 2^exponent in dtype (a NaN byte: 480 of its sign)."""
    value = np.array([byte], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0]
    if np.isnan(value):
        value = np.float32(-480.0 if byte & 0x80 else 480.0)
    scaled = np.ldexp(value, exponent).astype(np.float32)
    return int(np.array([scaled]).astype(dtype).view(np.uint16)[0])


def expected_bf16_bits(byte: int) -> int:
    return expected_bits(byte, ml_dtypes.bfloat16, -120)


def expected_f16_bits(byte: int) -> int:
    return expected_bits(byte, np.float16, -8)


def test_bits_give_every_e4m3_value_times_two_to_minus_120(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        skip_or_fail("building the e4m3 bit-field check needs a C++ compiler")
    source = tmp_path / "e4m3_bits_check.cpp"
    source.write_text(PROGRAM)
    binary = tmp_path / "e4m3_bits_check"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT}", str(source), "-o", str(binary)],
                   check=True, capture_output=True)
    rows = [tuple(map(int, line.split())) for line in
            subprocess.run([str(binary)], capture_output=True, text=True,
                           check=True).stdout.splitlines()]
    assert len(rows) == 256
    for byte, low, high, low16, high16 in rows:
        other = (byte * 37 + 11) & 0xFF
        want = expected_bf16_bits(byte) | expected_bf16_bits(other) << 16
        assert (low, high) == (want, want), (byte, hex(low), hex(high), hex(want))
        want16 = expected_f16_bits(byte) | expected_f16_bits(other) << 16
        assert (low16, high16) == (want16, want16), (byte, hex(low16), hex(high16), hex(want16))
    # Subnormal e4m3 values stay exact: the smallest, 2^-9, becomes 2^-129 (a bf16 subnormal) and
    # 2^-17 (an f16 subnormal).
    assert expected_bf16_bits(0x01) == 0x0010
    assert expected_f16_bits(0x01) == 0x0080
