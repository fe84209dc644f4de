"""The JAX_MLA_REQUIRE_GPU switch: where it is set, a GPU test this machine cannot run fails and
names what is missing, instead of skipping. Runs pytest on a few GPU tests with the FFI library
removed (JAX_MLA_FFI_LIB pointing at nothing), so it means the same on a CPU and on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from conftest import REQUIRE_GPU

ROOT = Path(__file__).parent.parent
TESTS = ["tests/test_decode.py::test_eager_equals_jit", "tests/test_gpu.py::test_soak_memory_is_stable",
         "tests/test_sharding.py::test_two_gpus"]
SINGLE_GPU = ["test_eager_equals_jit[fa3]", "test_eager_equals_jit[fa2]", "test_soak_memory_is_stable"]
NO_LIBRARY = "jax_mla's FFI library was not built"


def run_pytest(tmp_path, required: str | None):
    """(exit code, {test name: ("passed" | "skipped" | "failed", message)})."""
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_GPU}
    env["JAX_MLA_FFI_LIB"] = str(tmp_path / "removed" / "libjax_mla_ffi.so")
    if required is not None:
        env[REQUIRE_GPU] = required
    report = tmp_path / f"report-{required}.xml"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"--junitxml={report}", *TESTS], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        verdicts = [(child.tag, child.get("message", "")) for child in case
                    if child.tag in ("skipped", "failure", "error")]
        tag, message = verdicts[0] if verdicts else ("passed", "")
        outcomes[case.get("name")] = ("failed" if tag in ("failure", "error") else tag, message)
    return result.returncode, outcomes, result.stdout[-3000:]


def test_gpu_tests_fail_with_the_missing_piece_only_when_required(tmp_path):
    code, outcomes, log = run_pytest(tmp_path, None)
    assert code == 0, log
    assert outcomes["test_eager_equals_jit[xla]"][0] == "passed", log
    assert {name: outcomes[name][0] for name in SINGLE_GPU} == dict.fromkeys(SINGLE_GPU, "skipped")

    code, outcomes, log = run_pytest(tmp_path, "1")
    assert code != 0, log
    assert outcomes["test_eager_equals_jit[xla]"][0] == "passed", log
    for name in SINGLE_GPU:
        verdict, message = outcomes[name]
        assert verdict == "failed" and f"{REQUIRE_GPU}=1 requires the GPU tests" in message, (name, log)
        assert NO_LIBRARY in message, message
    two_gpus = {v for name, v in outcomes.items() if name.startswith("test_two_gpus")}
    assert two_gpus and "failed" not in {verdict for verdict, _ in two_gpus}, two_gpus  # N = 1

    code, outcomes, log = run_pytest(tmp_path, "2")
    two_gpus = {v for name, v in outcomes.items() if name.startswith("test_two_gpus")}
    assert code != 0 and {verdict for verdict, _ in two_gpus} == {"failed"}, log
    assert all(NO_LIBRARY in message for _, message in two_gpus)


def test_the_switch_must_be_a_gpu_count(tmp_path):
    env = dict(os.environ, **{REQUIRE_GPU: "yes"})
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_decode.py::test_auto_on_cpu_is_xla"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert f"{REQUIRE_GPU} must be a GPU count (0, 1, 2, ...), got 'yes'" in result.stdout + result.stderr


@pytest.mark.parametrize("value", ["", "0"])
def test_unset_or_zero_requires_nothing(monkeypatch, value):
    from conftest import required_gpus

    monkeypatch.setenv(REQUIRE_GPU, value)
    assert required_gpus() == 0
