"""Shared fixtures: random paged-cache problems with shuffled pages and NaN-poisoned unused memory."""

from __future__ import annotations

import importlib.util
import os

# Four host devices for tests/test_sharding.py, set before jax is imported; not where a GPU is expected.
if ("xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
        and not any(p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu"))
        and not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))):
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]))

import dataclasses
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from benchmarks.problem import relative_error, shuffled_block_tables
from jax_mla import backends, fp8_cache, gpu

jax.config.update("jax_enable_x64", False)

@dataclasses.dataclass
class Problem:
    query: jax.Array
    kv_cache: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    softmax_scale: float

    @property
    def arrays(self):
        return self.query, self.kv_cache, self.block_tables, self.seq_lens


def make_problem(seed, *, batch, q_len, num_heads, page_size, seq_lens=None, max_len=300,
                 kv_lora_rank=512, rope_dim=64, dtype=jnp.float32, spare_pages=3,
                 garbage_tables=True, growth=0.0) -> Problem:
    """A decode problem whose unused pages, page tails and table padding are all poisoned.

    ``growth``: token t of each request holds its N(0, 1) row times 1 + growth * t, so that scores
    keep rising along a request and an online softmax's running maximum moves every few blocks
    instead of settling after the first ones (and an fp8 cache's power-of-two group scales step
    up along the request).
    """
    rng = np.random.default_rng(seed)
    head_dim = kv_lora_rank + rope_dim
    if seq_lens is None:
        lengths = rng.integers(q_len, max_len + 1, size=batch)
        lengths[0] = q_len  # the shortest possible request
        if batch > 1:
            lengths[1] = page_size * max(1, max_len // (2 * page_size))  # an exact multiple
    else:
        lengths = np.asarray(seq_lens)
    pages_per_request = -(-lengths // page_size)
    max_pages = int(pages_per_request.max()) + 1  # one padding column at least
    num_pages = int(pages_per_request.sum()) + spare_pages
    tables, spare = shuffled_block_tables(rng, pages_per_request, num_pages, max_pages, fill=-7)
    if garbage_tables:
        # Padding entries may hold anything, out-of-range ids and an unused page included.
        for b, n in enumerate(pages_per_request):
            tables[b, n:] = rng.choice([-1, num_pages + 5, 10**6, *spare[-1:]], size=max_pages - n)
    cache = rng.standard_normal((num_pages, page_size, head_dim)).astype(np.float32)
    written = np.zeros((num_pages, page_size), bool)
    for b, n in enumerate(pages_per_request):
        flat = np.zeros(n * page_size, bool)
        flat[:lengths[b]] = True
        written[tables[b, :n]] = flat.reshape(n, page_size)
    cache[~written] = np.nan
    if growth:
        position = np.zeros((num_pages, page_size), np.float32)
        for b, n in enumerate(pages_per_request):
            position[tables[b, :n]] = np.arange(n * page_size).reshape(n, page_size)
        cache *= (1 + growth * position)[..., None]
    query = rng.standard_normal((batch, q_len, num_heads, head_dim)).astype(np.float32)
    return Problem(
        query=jnp.asarray(query, dtype),
        kv_cache=jnp.asarray(cache, dtype),
        block_tables=jnp.asarray(tables.astype(np.int32)),
        seq_lens=jnp.asarray(lengths.astype(np.int32)),
        softmax_scale=float(rng.uniform(0.05, 0.2)),
    )


# Unused fp8 rows: 0x7F bytes are NaN as e4m3 but a huge finite float32 scale and bf16 rope value;
# 0xFF bytes are NaN in all three.
POISON_BYTES = (0x7F, 0xFF)


def scaled_up(problem: Problem, factor: float = 2.0**14) -> Problem:
    """``problem`` with every cache value times ``factor`` (a power of two) and ``softmax_scale``
    over it: the same scores and LSE, outputs ``factor`` times larger. On the fp8 cache 2^14 gives
    N(0, 1) rows group scales of 2^7 and 2^8, either side of the largest that e4m3's bit-field
    conversion takes (docs/fp8-cache.md)."""
    return dataclasses.replace(problem, kv_cache=problem.kv_cache * factor,
                               softmax_scale=problem.softmax_scale / factor)


def fp8_problem(problem: Problem, seed: int) -> tuple[Problem, Problem]:
    """(the problem with an fp8 cache, the problem with the bf16 cache it was quantised from).

    Written rows are quantised from the bf16-rounded values; unused rows (NaN in ``problem``) hold
    NaN bytes, 0x7F or 0xFF at random. The query keeps ``problem``'s dtype.
    """
    values = np.asarray(jnp.asarray(problem.kv_cache, jnp.bfloat16), np.float32)
    num_pages, page_size, head_dim = values.shape
    flat = values.reshape(-1, head_dim)
    unused = np.isnan(flat).any(axis=-1)
    latent, rope = np.nan_to_num(flat[:, :head_dim - 64]), np.nan_to_num(flat[:, head_dim - 64:])
    rows = np.array(fp8_cache.quantize_rows(jnp.asarray(latent), jnp.asarray(rope)))
    rows[unused] = np.random.default_rng(seed).choice(POISON_BYTES, size=(unused.sum(), 1))
    fp8 = jnp.asarray(rows.reshape(num_pages, page_size, -1))
    bf16 = jnp.asarray(values, jnp.bfloat16)
    return dataclasses.replace(problem, kv_cache=fp8), dataclasses.replace(problem, kv_cache=bf16)


HAS_TVM_FFI = importlib.util.find_spec("tvm_ffi") is not None


def build_host_check(out_dir, name: str, *flags: str,
                     gencode: str = "arch=compute_90a,code=sm_90a") -> str:
    """tests/<name>.cu built by nvcc (C++17, -O1, the repository on the include path, ``flags``)
    into ``out_dir``, for the host checks of the sm90 kernels' device code; the binary's path.
    Without nvcc the test is skipped, or fails under JAX_MLA_REQUIRE_GPU."""
    if shutil.which("nvcc") is None:
        skip_or_fail(f"building tests/{name}.cu needs nvcc")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    binary = os.path.join(str(out_dir), name)
    subprocess.run(["nvcc", "-std=c++17", "-O1", f"-I{root}", *flags, "-gencode", gencode,
                    os.path.join(root, "tests", f"{name}.cu"), "-o", binary], check=True,
                   capture_output=True)
    return binary


def build_ffi_target(tmp_path_factory, target: str):
    """Builds one CMake target of ffi/ here for sm_90a (needs nvcc and apache-tvm-ffi); its library."""
    if shutil.which("nvcc") is None or not HAS_TVM_FFI:
        skip_or_fail("building ffi/ needs nvcc and apache-tvm-ffi")
    build = tmp_path_factory.mktemp(target)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["cmake", "-S", root, "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=90a",
                    "-DJAX_MLA_BUILD_PLAN_TWIN=ON"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", target], check=True, capture_output=True)
    return build / "ffi" / f"lib{target}.so"


@pytest.fixture(scope="session")
def ffi_library_path(tmp_path_factory):
    """The installed FFI library, else one built here from ffi/."""
    path = gpu.library_path()
    return path if path is not None else build_ffi_target(tmp_path_factory, "jax_mla_ffi")


@pytest.fixture(scope="session")
def plan_twin_path(tmp_path_factory):
    """The GPU planner's host twin: a test-only library, never installed, built here from ffi/."""
    return build_ffi_target(tmp_path_factory, "jax_mla_plan_twin")


def gpu_backends_here() -> list[str]:
    return [b for b in backends.available_backends() if b != backends.XLA]


def backend_params():
    """Every backend, GPU ones marked ``gpu`` and skipped where this machine cannot run them."""
    params = [pytest.param(backends.XLA, id="xla")]
    runnable = gpu_backends_here()
    for name in (backends.FA3, backends.FA2, backends.SM90):
        marks = [pytest.mark.gpu]
        if name not in runnable:
            why = gpu_blocker() or f"this GPU does not run it ({runnable=})"
            marks.append(pytest.mark.skip(reason=f"{name}: {why}"))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


# ---- accuracy --------------------------------------------------------------------------------------

# Worst output error allowed per request and head (over that request/head's own max |reference|)
# and worst lse error in nats, by dtype; docs/testing.md has the measurements behind them.
XLA_TOLERANCES = {"float32": (3e-5, 5e-5), "bfloat16": (1e-2, 5e-5)}
GPU_KERNEL_TOLERANCES = {"bfloat16": (2e-2, 4e-3)}


def tolerances(backend: str, dtype) -> tuple[float, float]:
    """(output error, lse error in nats) that ``backend`` must meet in ``dtype``."""
    kernel = backends.BY_NAME.get(backend)
    gpu_kernel = kernel is not None and kernel.runs_on_capability is not None
    table = GPU_KERNEL_TOLERANCES if gpu_kernel else XLA_TOLERANCES  # xla, and the torch reference
    return table[jnp.dtype(dtype).name]


def request_head_error(actual, expected) -> float:
    """The worst, over requests and heads, of max |actual - expected| / max |expected| taken over
    that request's query tokens and channels of that head. Arrays [B, q_len, H, R]."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not np.isfinite(actual).all():
        return float("inf")
    error = np.abs(actual - expected).max(axis=(1, 3))
    scale = np.abs(expected).max(axis=(1, 3))
    return float((error / np.maximum(scale, 1e-6)).max())


def lse_error(actual, expected) -> float:
    """Worst |actual - expected| in nats; rows that see nothing must be -inf in both."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    empty = np.isneginf(expected)
    if not np.array_equal(np.isneginf(actual), empty) or not np.isfinite(actual[~empty]).all():
        return float("inf")
    return float(np.abs(actual[~empty] - expected[~empty]).max(initial=0.0))


ACCURACY: dict[tuple[str, str], dict[str, tuple[float, str]]] = {}


def record_accuracy(backend: str, dtype, **errors: float) -> None:
    """Keep the worst error of each kind per (backend, dtype) for the end-of-run summary."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    worst = ACCURACY.setdefault((backend, jnp.dtype(dtype).name), {})
    for kind, value in errors.items():
        if value >= worst.get(kind, (-1.0, ""))[0]:
            worst[kind] = (value, test)


def check_accuracy(out, lse, ref_out, ref_lse, *, backend: str) -> tuple[float, float]:
    """Assert ``backend``'s (out, lse) meet its tolerances against a reference; returns the errors."""
    out_error = request_head_error(out, ref_out)
    lse_err = lse_error(lse, ref_lse)
    record_accuracy(backend, out.dtype, output=out_error, lse=lse_err)
    out_tol, lse_tol = tolerances(backend, out.dtype)
    assert out_error < out_tol, f"{backend}: output error {out_error:.2e} per request/head >= {out_tol}"
    assert lse_err < lse_tol, f"{backend}: lse error {lse_err:.2e} nats >= {lse_tol}"
    return out_error, lse_err


def assert_custom_calls_in_command_buffers(dump_dir) -> None:
    """In the thunk sequence XLA dumped for a jitted ``step`` (jax 0.11 forms command buffers at
    the thunk level), every custom call sits inside a command buffer and none outside."""
    thunks = "".join(p.read_text()
                     for p in dump_dir.glob("*jit_step*thunk_sequence_after_thunk_passes.txt"))
    top_level = [line for line in thunks.splitlines() if re.match(r"\d+: ", line)]
    nested = [line for line in thunks.splitlines() if re.match(r"\s+\d+: ", line)]
    assert any("kCommandBuffer" in line for line in top_level), thunks[:3000]
    assert any("kCustomCall" in line for line in nested), thunks[:3000]
    assert not any("kCustomCall" in line for line in top_level), thunks[:3000]


def custom_calls_in_loops(hlo: str) -> list[str]:
    """The custom-call targets a compiled program (``compiled.as_text()``) runs inside a while
    loop: in a loop's body or condition, or in any computation those reach, once per target."""
    computations, name, lines = {}, None, []
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)
        if header:
            name, lines = header.group(1), []
        elif line == "}" and name is not None:
            computations[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    inside = set(re.findall(r"\b(?:body|condition)=%([\w.\-]+)", hlo)) & computations.keys()
    frontier = list(inside)
    while frontier:
        called = set(re.findall(r"%([\w.\-]+)", computations[frontier.pop()])) & computations.keys()
        frontier += sorted(called - inside)
        inside |= called
    return sorted({target for name in inside
                   for target in re.findall(r'custom_call_target="([^"]+)"', computations[name])})


def pytest_terminal_summary(terminalreporter):
    """The worst accuracy each backend reached in this run (the GPU logs keep it)."""
    if not ACCURACY:
        return
    terminalreporter.write_sep("-", "jax_mla accuracy: worst error per request/head, worst lse (nats)")
    for (backend, dtype), worst in sorted(ACCURACY.items()):
        for kind, (value, test) in sorted(worst.items()):
            terminalreporter.write_line(f"{backend:10} {dtype:9} {kind:7} {value:.3e}  {test}")


# ---- the switch that makes GPU tests required ------------------------------------------------------

REQUIRE_GPU = "JAX_MLA_REQUIRE_GPU"


def required_gpus() -> int:
    """How many GPUs $JAX_MLA_REQUIRE_GPU says this run must test on (0 or unset: GPU tests may skip)."""
    value = os.environ.get(REQUIRE_GPU, "").strip() or "0"
    if not value.isdigit():
        raise pytest.UsageError(f"{REQUIRE_GPU} must be a GPU count (0, 1, 2, ...), got {value!r}")
    return int(value)


def gpu_blocker(gpus: int = 1) -> str | None:
    """What keeps this machine from running jax_mla's GPU backends on ``gpus`` GPUs, or None."""
    found = sum(device.platform == "gpu" for device in jax.devices())
    missing = []
    if found < gpus:
        missing.append(f"JAX sees {found} CUDA GPU(s), {gpus} needed (default backend "
                       f"{jax.default_backend()!r})")
    runtime = gpu.runtime_missing()
    if runtime:
        missing.append(runtime)
    return "; ".join(missing) or None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under JAX_MLA_REQUIRE_GPU=N a ``gpu`` test (``multi_gpu``: when N >= 2) that this machine
    cannot run fails, naming what is missing, before any skip mark is read."""
    required = required_gpus()
    if not required or item.get_closest_marker("gpu") is None:
        return
    gpus = 2 if item.get_closest_marker("multi_gpu") else 1
    if gpus > required:
        return
    blocker = gpu_blocker(gpus)
    if blocker:
        pytest.fail(f"{REQUIRE_GPU}={required} requires the GPU tests, but {blocker}", pytrace=False)


def skip_or_fail(reason: str):
    """Skip a GPU test, or fail it under JAX_MLA_REQUIRE_GPU (a setup problem, not the hardware)."""
    if required_gpus():
        pytest.fail(f"{REQUIRE_GPU} requires the GPU tests, but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def problem_factory():
    return make_problem


__all__ = ["Problem", "backend_params", "check_accuracy", "jax_mla", "make_problem", "relative_error",
           "request_head_error"]


HOPPER_BACKENDS = ("fa3", "fa2", "sm90", "xla")


def record_kernel_runs(monkeypatch, names, available=HOPPER_BACKENDS) -> list[str]:
    """A GPU with the backends ``available`` (``backends.available_backends`` patched; default a
    Hopper's) whose backends ``names`` run stand-in kernels (zeros) that append their name to the
    list returned, at trace time: which kernel ``decode`` chose, without a GPU."""
    ran: list[str] = []

    def recording(name):
        def decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
                   kv_lora_rank, plan, fail_closed):
            ran.append(name)
            batch, q_len, num_heads, _ = query.shape
            return (jnp.zeros((batch, q_len, num_heads, kv_lora_rank), query.dtype),
                    jnp.zeros((batch, q_len, num_heads), jnp.float32))
        return dataclasses.replace(backends.BY_NAME[name], decode=decode)

    for name in names:
        monkeypatch.setitem(backends.BY_NAME, name, recording(name))
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: list(available))
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    return ran
