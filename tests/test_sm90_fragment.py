"""The sm90 kernel's transposed-score index math, run on the host (``tests/sm90_fragment_check.cpp``
includes the same ``ffi/sm90/fragment_layout.h`` as the kernel): every (token, query row) of S^T
held once, P written once by the two warpgroups, every (column, query row) of a warpgroup's O^T
held once, every row's LSE written once; the fp8 path's permuted query columns, whose every
A fragment is four consecutive cache channels; and the same for the fp8 register-operand kernels,
whose output columns come in pairs and whose P stores (stmatrix.trans, emulated) write every
(query row, token) of a tile once, at 16 and 32 rows."""

from __future__ import annotations

import os
import shutil
import subprocess

from conftest import skip_or_fail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transposed_score_fragments_cover_every_token_and_row_once(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        skip_or_fail("building tests/sm90_fragment_check.cpp needs a C++ compiler")
    binary = tmp_path / "sm90_fragment_check"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT}",
                    f"{ROOT}/tests/sm90_fragment_check.cpp", "-o", str(binary)], check=True,
                   capture_output=True)
    lines = subprocess.run([str(binary)], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert lines == ["ok 16", "ok 32", "ok permuted-query", "ok register-operands",
                     "ok p-store 16", "ok p-store 32"], lines
