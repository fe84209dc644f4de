#!/usr/bin/env python3
"""Benchmark MLA decode: jax_mla against FlashInfer called from torch and against plain XLA.

One command per piece of the grid, on one GPU (see benchmarks/README.md):

    python benchmarks/decode.py --grid full --piece 1/4 --time-limit 450
    python benchmarks/decode.py --dry-run --out /tmp/bench.json       # CPU, xla backends, tiny grid

For every point (B, L, H, q_len, page_size) it builds one paged problem (lengths uniform in
[L/2, 3L/2], shuffled pages, random bf16 data) in several cache copies that are rotated between
calls so that L2 never serves the reads, checks every method's output against a float32 torch
reference before timing it, times it, and merges one record per point into the JSON file given by
``--out`` (existing records with other keys are kept; a rerun skips points already measured).

Methods (``--backends``):
  jax_mla         jax_mla.decode(backend="auto", plan=jax_mla.plan(...)) inside jax.jit, N layers
  jax_mla_graph   jax_mla with XLA command buffers (CUDA graphs) forced on for the step; B <= 32
  jax_mla_noplan  jax_mla without a plan (plans inside each call); on a small sub-grid only
  jax_mla_device_plan  the schedule built on the GPU inside the jitted step (jax_mla.device_plan),
                  shared by its layers (as a CUDA graph where jax_mla_graph is timed too); also
                  times the planner kernel alone (device_plan_us, from a profiler trace) and per
                  call in CUDA graphs of 128 planner calls (device_plan_graph_us)
  flashinfer      flashinfer.mla.BatchMLAPagedAttentionWrapper from torch (run() timed, plan apart)
  xla_naive       plain XLA: gather pages with the block table, einsum, masked softmax, einsum
  jax_mla_xla     jax_mla.decode(backend="xla") (the chunked pure-XLA backend)
  jax_mla_step    (only when named) a whole --step-layers (61) step end to end, host plan every
                  step vs device plan in the step: step_host_plan_ms, step_device_plan_ms
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import hashlib
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np

# ---------------------------------------------------------------------------------------------
# Constants: the H200 ceilings measured on this machine kind (../shared/docs/performance.md)
# ---------------------------------------------------------------------------------------------
PEAK_FLOPS = 790e12  # dense bf16 matmul, FLOP/s
PEAK_BYTES = 4.3e12  # device copy, B/s
L2_BYTES = 60e6
KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
SOFTMAX_SCALE = 0.135234  # DeepSeek-V3: 192**-0.5 * mscale**2
CHECK_REQUESTS = 4  # requests checked against the float32 torch reference at every point
CHECK_TOL = 2e-2  # max |out - ref| / max |ref| for bf16 outputs
GIB = 1 << 30

METHODS = ("jax_mla", "jax_mla_graph", "jax_mla_noplan", "jax_mla_device_plan", "flashinfer",
           "xla_naive", "jax_mla_xla", "jax_mla_step")
# XLA command buffers (CUDA graphs) for every run of the step, custom calls included, whatever its
# size; per compile, so one process times the step with and without them.
GRAPH_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,WHILE,CONDITIONAL",
                          "xla_gpu_graph_min_graph_size": "1"}
GPU_DEFAULT_METHODS = tuple(m for m in METHODS if m != "jax_mla_step")  # a whole step: when asked
DRY_DEFAULT_METHODS = ("jax_mla", "xla_naive", "jax_mla_xla")
FI_BACKENDS = ("fa3", "fa2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, order=True)
class Point:
    B: int
    L: int
    H: int
    q_len: int
    page_size: int

    @property
    def key(self) -> str:
        return f"B{self.B}-L{self.L}-H{self.H}-q{self.q_len}-p{self.page_size}"

    @property
    def label(self) -> str:
        return f"B={self.B} L={fmt_len(self.L)} H={self.H} q={self.q_len} p={self.page_size}"


def fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def parse_len(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def full_grid() -> list[Point]:
    points = [Point(b, l, h, q, 64)
              for h in (16, 128) for q in (1, 2) for b in (1, 32, 128, 512)
              for l in (1024, 4096, 16384, 32768)]
    points += page32_grid()
    return points


def page32_grid() -> list[Point]:
    return [Point(b, l, h, 1, 32) for h in (16, 128) for b in (32, 128) for l in (4096, 16384)]


def quick_grid() -> list[Point]:
    return [Point(1, 1024, 128, 1, 64), Point(32, 4096, 128, 1, 64), Point(128, 4096, 16, 1, 64),
            Point(128, 4096, 128, 2, 64), Point(128, 16384, 128, 1, 64), Point(512, 4096, 128, 1, 64)]


def dry_grid() -> list[Point]:
    return [Point(1, 64, 4, 1, 16), Point(3, 96, 2, 2, 32)]


GRIDS = {"full": full_grid, "quick": quick_grid, "page32": page32_grid, "dry": dry_grid}


def noplan_subset(pt: Point) -> bool:
    """The small sub-grid where jax_mla_noplan is timed (it syncs inside every call)."""
    return pt.B <= 128 and pt.L <= 4096 and pt.page_size == 64 and pt.q_len == 1


def graph_subset(pt: Point) -> bool:
    """Where jax_mla_graph is timed: small batches, where launch overhead is a share of the time."""
    return pt.B <= 32


def method_applies(method: str, pt: Point, args) -> bool:
    if method == "jax_mla_noplan":
        return args.noplan_everywhere or noplan_subset(pt)
    if method == "jax_mla_graph":
        return graph_subset(pt)
    return True


def parse_point_filters(specs: list[str]) -> list[dict[str, set[int]]]:
    """``--points 'B=128,L=4k|16k,H=16'`` (repeatable; a point matching any spec is kept)."""
    filters = []
    names = {"b": "B", "l": "L", "h": "H", "q": "q_len", "q_len": "q_len", "p": "page_size",
             "page": "page_size", "page_size": "page_size"}
    for spec in specs:
        for part in spec.split(";"):
            if not part.strip():
                continue
            f: dict[str, set[int]] = {}
            for item in part.split(","):
                if "=" not in item:
                    raise SystemExit(f"--points: expected NAME=VALUE[|VALUE...], got {item!r}")
                name, values = item.split("=", 1)
                field = names.get(name.strip().lower())
                if field is None:
                    raise SystemExit(f"--points: unknown field {name!r} (use B, L, H, q, page)")
                f[field] = {parse_len(v) for v in values.split("|")}
            filters.append(f)
    return filters


def point_matches(pt: Point, filters) -> bool:
    return not filters or any(all(getattr(pt, k) in v for k, v in f.items()) for f in filters)


# ---------------------------------------------------------------------------------------------
# Problem layout (host side, numpy: cheap, deterministic, used for costs and memory checks too)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Layout:
    point: Point
    seed: int
    lengths: np.ndarray  # int32 [B]
    pages_per_request: np.ndarray
    tables: np.ndarray  # int32 [B, max_pages], pages shuffled, padding 0
    num_pages: int

    @property
    def max_pages(self) -> int:
        return self.tables.shape[1]

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.point.page_size * HEAD_DIM * 2

    @property
    def kv_indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.pages_per_request)]).astype(np.int32)

    @property
    def kv_indices(self) -> np.ndarray:
        return np.concatenate([self.tables[b, :n] for b, n in enumerate(self.pages_per_request)]
                              ).astype(np.int32)


def point_seed(pt: Point, base: int) -> int:
    digest = hashlib.sha256(f"{base}:{pt.key}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_layout(pt: Point, base_seed: int) -> Layout:
    seed = point_seed(pt, base_seed)
    rng = np.random.default_rng(seed)
    low, high = pt.L // 2, (3 * pt.L) // 2
    lengths = rng.integers(low, high + 1, size=pt.B)
    # Shift so the mean is L (B=1 gets exactly L): the table's L is the mean length, not a draw.
    lengths = np.clip(lengths + int(round(pt.L - lengths.mean())), low, high)
    lengths = np.maximum(lengths, pt.q_len).astype(np.int32)
    pages = -(-lengths // pt.page_size)
    num_pages = int(pages.sum())
    order = rng.permutation(num_pages).astype(np.int32)
    tables = np.zeros((pt.B, int(pages.max())), np.int32)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = order[start:start + n]
        start += n
    return Layout(pt, seed, lengths, pages.astype(np.int32), tables, num_pages)


def work(layout: Layout) -> dict:
    """FLOPs, bytes and the floor of one decode call (one layer)."""
    pt = layout.point
    tokens = int(layout.lengths.astype(np.int64).sum())
    flops = 2 * (HEAD_DIM + KV_LORA_RANK) * pt.H * pt.q_len * tokens
    nbytes = tokens * HEAD_DIM * 2 + pt.B * pt.q_len * pt.H * (HEAD_DIM + KV_LORA_RANK) * 2
    floor_s = max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)
    return {"sum_len": tokens, "mean_len": tokens / pt.B, "max_len": int(layout.lengths.max()),
            "flops": flops, "bytes": nbytes, "intensity": flops / nbytes,
            "floor_us": floor_s * 1e6,
            "floor_bound": "compute" if flops / PEAK_FLOPS >= nbytes / PEAK_BYTES else "memory"}


def cache_count(layout: Layout, budget_bytes: float, l2_bytes: float = L2_BYTES) -> int:
    """Caches to rotate: enough that the other caches read between two reads of one exceed 2x L2.

    0 when even one cache exceeds the budget (the point is skipped)."""
    size = layout.cache_bytes
    wanted = max(2, 1 + math.ceil(2 * l2_bytes / size))
    return min(wanted, int(budget_bytes // size))


def naive_temp_bytes(layout: Layout) -> int:
    """What plain XLA materialises: the gathered cache plus ~3 float32 copies of the logits."""
    pt = layout.point
    tokens = layout.max_pages * pt.page_size
    return pt.B * tokens * HEAD_DIM * 2 + 3 * pt.B * pt.q_len * pt.H * tokens * 4


# ---------------------------------------------------------------------------------------------
# Estimated run time per point (to split the grid into pieces and to honour --time-limit)
# ---------------------------------------------------------------------------------------------
def estimate_cost_s(layout: Layout, methods: list[str], args) -> float:
    w = work(layout)
    n = max(1, cache_count(layout, args.mem_budget_gib * GIB, args.l2_bytes))
    floor_s = w["floor_us"] * 1e-6
    cost = 3.0 + n * layout.cache_bytes / 20e9  # setup, random fill, reference check
    for m in methods:
        if not method_applies(m, layout.point, args):
            continue
        if m in ("jax_mla", "jax_mla_graph", "jax_mla_noplan", "jax_mla_device_plan"):
            cost += 2.0 + min(args.max_method_s, 10 * 2.5 * floor_s * args.layers) + 0.5
        elif m == "flashinfer":
            cost += len(args.fi_backends) * (1.5 + 2 * min(1.0, 15 * 2.5 * floor_s * args.layers))
        elif m == "xla_naive" and naive_temp_bytes(layout) <= args.naive_mem_gib * GIB:
            cost += 2.0 + min(args.max_method_s, 10 * 15 * floor_s * args.xla_layers)
        elif m == "jax_mla_xla":
            cost += 3.0 + min(args.max_call_s, 10 * 60 * floor_s * args.xla_layers)
        elif m == "jax_mla_step":
            cost += 2 * (6.0 + min(args.max_method_s, 10 * 2.5 * floor_s * args.step_layers))
    return cost


def split_pieces(points: list[Point], costs: dict[Point, float], n: int) -> list[list[Point]]:
    """Longest-processing-time split into n pieces of similar estimated cost (deterministic)."""
    pieces: list[list[Point]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for pt in sorted(points, key=lambda p: (-costs[p], p)):
        i = min(range(n), key=lambda j: (loads[j], j))
        pieces[i].append(pt)
        loads[i] += costs[pt]
    return [sorted(p, key=lambda q: (costs[q], q)) for p in pieces]


# ---------------------------------------------------------------------------------------------
# Progress on stderr: one line, rewritten in place on a terminal, one line per point otherwise
# ---------------------------------------------------------------------------------------------
class Progress:
    def __init__(self, total_cost: float, n_points: int, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.total_cost = max(total_cost, 1e-9)
        self.n = n_points
        self.i = 0
        self.done_cost = 0.0
        self.start = time.perf_counter()
        self.label = ""

    @staticmethod
    def _fmt(seconds: float) -> str:
        seconds = int(max(0, seconds))
        return f"{seconds // 60}m{seconds % 60:02d}s"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _head(self) -> str:
        el = self.elapsed()
        eta = el / self.done_cost * (self.total_cost - self.done_cost) if self.done_cost else None
        eta_s = self._fmt(eta) if eta is not None else "?"
        return f"[{self.i}/{self.n} {self._fmt(el)} eta {eta_s}]"

    def begin(self, index: int, label: str):
        self.i = index
        self.label = label
        self.status("setup")

    def status(self, text: str):
        if not self.tty:
            return
        cols = shutil.get_terminal_size((120, 20)).columns
        line = f"{self._head()} {self.label} | {text}"
        self.stream.write("\r\x1b[2K" + line[:cols - 1])
        self.stream.flush()

    def end(self, cost: float, summary: str):
        self.done_cost += cost
        self.line(f"{self._head()} {self.label} | {summary}")

    def line(self, text: str):
        self.stream.write(("\r\x1b[2K" if self.tty else "") + text + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# Environment record
# ---------------------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return str(getattr(module, "__version__", "unknown"))


def _dist_version(name: str) -> str | None:
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:  # noqa: BLE001
        return None


def commit_id() -> str | None:
    if os.environ.get("JAX_MLA_COMMIT"):
        return os.environ["JAX_MLA_COMMIT"]
    head = _run(["git", "rev-parse", "HEAD"], cwd=REPO)
    if head and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO):
        head += "+dirty"
    return head


def environment(dry_run: bool, torch_mod) -> dict:
    import jax

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(),
           "jax": jax.__version__, "jaxlib": _dist_version("jaxlib"),
           "jax_cuda_plugin": _dist_version("jax-cuda13-plugin") or _dist_version("jax-cuda12-plugin"),
           "jax_mla": _version("jax_mla"), "commit": commit_id(),
           "jax_platform": jax.default_backend(), "dry_run": dry_run,
           "torch": getattr(torch_mod, "__version__", None) if torch_mod else _dist_version("torch"),
           "flashinfer": _dist_version("flashinfer-python"), "triton": _dist_version("triton"),
           "peak_flops": PEAK_FLOPS, "peak_bytes_per_s": PEAK_BYTES, "l2_bytes": L2_BYTES,
           "gpu": None, "driver": None, "cuda": None}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        name, _, driver = smi.splitlines()[0].partition(",")
        env["gpu"], env["driver"] = name.strip(), driver.strip()
        header = _run(["nvidia-smi"]) or ""
        if "CUDA Version:" in header:
            env["cuda_driver_api"] = header.split("CUDA Version:")[1].split()[0]
    device = jax.devices()[0]
    if env["gpu"] is None:
        env["gpu"] = getattr(device, "device_kind", device.platform)
    if torch_mod is not None and getattr(torch_mod.version, "cuda", None):
        env["cuda"] = torch_mod.version.cuda
    elif env.get("cuda_driver_api"):
        env["cuda"] = env["cuda_driver_api"]
    try:
        import jax_mla
        env["jax_mla_backends"] = jax_mla.available_backends()
    except Exception as e:  # noqa: BLE001
        env["jax_mla_backends"] = f"error: {e}"
    return env


# ---------------------------------------------------------------------------------------------
# Output file: merge records by key, written after every point (atomic replace)
# ---------------------------------------------------------------------------------------------
def load_results(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        data.setdefault("records", [])
        data.setdefault("runs", [])
        return data
    return {"schema": 1, "env": {}, "runs": [], "records": []}


def save_results(path: str, data: dict, copy_to: str | None = None) -> None:
    data["records"].sort(key=lambda r: (r.get("page_size", 0), r.get("H", 0), r.get("q_len", 0),
                                        r.get("B", 0), r.get("L", 0)))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    if copy_to:
        os.makedirs(copy_to, exist_ok=True)
        shutil.copyfile(path, os.path.join(copy_to, os.path.basename(path)))


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def merge_record(data: dict, record: dict) -> None:
    for old in data["records"]:
        if old.get("key") == record["key"]:
            errors = {**old.get("errors", {}), **record.get("errors", {})}
            for m in record.get("methods_done", []):  # a fresh measurement clears an old error
                if m not in record.get("errors", {}):
                    errors.pop(m, None)
            done = sorted(set(old.get("methods_done", [])) | set(record.get("methods_done", [])))
            old.update(record)
            old["errors"] = errors
            old["methods_done"] = done
            return
    data["records"].append(record)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def median(xs):
    return float(statistics.median(xs))


def time_jax(fn, arg_sets: list[tuple], layers: int, args) -> tuple[float, int]:
    """Seconds per layer: back-to-back jitted calls (async dispatch), blocking once per round.

    Returns (median seconds per layer, rounds). A call slower than --max-method-s is measured once.
    """
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    one = time.perf_counter() - start
    if one >= args.max_method_s:
        return one / layers, 1
    calls = max(1, min(2000, math.ceil(args.round_s / max(one, 1e-6))))
    samples = []
    spent = one
    k = 1
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*arg_sets[k % len(arg_sets)])
            k += 1
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        del out
        samples.append(dt / (calls * layers))
        spent += dt
        if spent > args.max_method_s and len(samples) >= 2:
            break
    return median(samples), len(samples)


def time_torch(fn, per_call: int, args, torch) -> tuple[float, str]:
    """Seconds per layer of ``fn`` (which runs ``per_call`` layers) on the GPU.

    triton.testing.do_bench (median; it flushes L2 before each call) where triton imports, else
    CUDA events around rounds of back-to-back calls."""
    try:
        from triton.testing import do_bench
    except Exception:  # noqa: BLE001
        do_bench = None
    if do_bench is not None:
        kwargs = {"warmup": args.do_bench_warmup_ms, "rep": args.do_bench_rep_ms}
        if "return_mode" in inspect.signature(do_bench).parameters:
            kwargs["return_mode"] = "median"
            ms = do_bench(fn, **kwargs)
        else:
            ms = do_bench(fn, quantiles=[0.5], **kwargs)
        if isinstance(ms, (list, tuple)):
            ms = ms[0]
        return float(ms) * 1e-3 / per_call, "triton.do_bench(median)"
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = start.elapsed_time(end) * 1e-3
    calls = max(1, min(1000, math.ceil(args.round_s / max(one, 1e-6))))
    samples = []
    for _ in range(args.rounds):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / (calls * per_call))
    return median(samples), "cuda_events(median of rounds)"


def host_time_us(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return median(samples) * 1e6


# ---------------------------------------------------------------------------------------------
# JAX side: data, the decode variants, the N-layer jitted step
# ---------------------------------------------------------------------------------------------
def _fill_fns():
    import jax
    import jax.numpy as jnp
    from jax import lax

    def write_chunk(cache, key, start, n):
        chunk = jax.random.normal(key, (n,) + cache.shape[1:], jnp.float32).astype(cache.dtype)
        return lax.dynamic_update_slice(cache, chunk, (start, 0, 0))

    return jax.jit(write_chunk, static_argnums=(3,), donate_argnums=(0,))


_WRITE_CHUNK = None


def random_cache(seed: int, num_pages: int, page_size: int):
    """A [num_pages, page_size, 576] bf16 cache of N(0, 1) values, filled in chunks of ~256 MiB."""
    global _WRITE_CHUNK
    import jax
    import jax.numpy as jnp

    if _WRITE_CHUNK is None:
        _WRITE_CHUNK = _fill_fns()
    cache = jnp.zeros((num_pages, page_size, HEAD_DIM), jnp.bfloat16)
    chunk = max(1, (256 << 20) // (page_size * HEAD_DIM * 4))
    key = jax.random.PRNGKey(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "donated buffers were not usable" on CPU
        for start in range(0, num_pages, chunk):
            key, sub = jax.random.split(key)
            n = min(chunk, num_pages - start)
            cache = _WRITE_CHUNK(cache, sub, np.int32(start), n)
    return cache


def xla_naive_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale):
    """MLA decode the way a JAX user writes it today: gather, einsum, masked softmax, einsum."""
    import jax
    import jax.numpy as jnp

    batch, q_len, _, head_dim = query.shape
    kv = kv_cache[block_tables].reshape(batch, -1, head_dim)  # [B, max_pages * page_size, 576]
    logits = jnp.einsum("bshd,btd->bsht", query, kv, preferred_element_type=jnp.float32)
    logits = logits * softmax_scale
    positions = jnp.arange(kv.shape[1])
    visible_end = seq_lens[:, None] - q_len + 1 + jnp.arange(q_len)[None, :]  # [B, q_len]
    mask = positions[None, None, :] < visible_end[:, :, None]
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(query.dtype)
    out = jnp.einsum("bsht,btd->bshd", probs, kv[..., :KV_LORA_RANK],
                     preferred_element_type=jnp.float32)
    return out.astype(query.dtype)


def kernel_durations_us(trace_dir: str, kernel_name: str) -> list[float]:
    """Durations (µs) of the events named like ``kernel_name`` in the perfetto traces under
    ``trace_dir`` (what ``jax.profiler.trace(..., create_perfetto_trace=True)`` writes)."""
    import glob
    import gzip

    durations = []
    for path in glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True):
        with gzip.open(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        durations += [float(e["dur"]) for e in events
                      if kernel_name in str(e.get("name", "")) and "dur" in e]
    return durations


def profiled_kernel_us(run, kernel_name: str) -> tuple[list[float], str | None]:
    """(durations in µs of every launch of the GPU kernel named like ``kernel_name`` while
    ``run()`` executes under the JAX profiler, why there are none or None)."""
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        try:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                run()
        except RuntimeError as e:  # e.g. no CUPTI, or another trace running
            return [], f"profiler: {e}"
        durations = kernel_durations_us(trace_dir, kernel_name)
    return durations, None if durations else f"no {kernel_name} events in the profiler trace"


def name_plan_comparison(record: dict) -> None:
    """The host- vs device-schedule fields under the names the planner's goal uses: µs per layer of
    the decode run with either schedule, from steps of N layers. The device-planned step also runs
    the planner once, so its share (its graph node's time / N, timed apart) is taken out. Where
    the device-planned step was replayed as a CUDA graph, it is compared with the host-planned step
    replayed the same way (jax_mla_graph_us)."""
    if record.get("plan_us") is None or record.get("jax_mla_device_plan_us") is None:
        return
    layers = record.get("jax_mla_device_plan_layers") or record["layers"]
    host_field = "jax_mla_graph_us" if record.get("jax_mla_device_plan_in_graph") else "jax_mla_us"
    planner = record.get("device_plan_graph_us") or record.get("device_plan_us") or 0.0
    record["run_with_host_plan_us"] = record[host_field]
    record["run_with_device_plan_us"] = record["jax_mla_device_plan_us"] - planner / layers


def decode_with_plan(query, cache, tables, lens, plan):
    """One layer: jax_mla.decode with backend "auto" and the step's plan."""
    import jax_mla

    return jax_mla.decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE, plan=plan)


def layered(decode_one, layers: int, compiler_options: dict | None = None):
    """jit(f)(q, caches, tables, lens, plan) -> one output per layer; layer i reads caches[i]."""
    import jax

    def step(query, caches, tables, lens, plan):
        return tuple(decode_one(query, caches[i], tables, lens, plan) for i in range(layers))

    return jax.jit(step, compiler_options=compiler_options)


def device_planned(decode_one, layers: int, pt, max_pages: int, compiler_options: dict | None = None):
    """Like ``layered``, but the step builds its schedule on the GPU once and shares it."""
    import jax
    import jax_mla

    def step(query, caches, tables, lens, plan):
        del plan
        device = jax_mla.device_plan(lens, num_heads=pt.H, q_len=pt.q_len, max_pages=max_pages)
        return tuple(decode_one(query, caches[i], tables, lens, device) for i in range(layers))

    return jax.jit(step, compiler_options=compiler_options)


def rotation_sets(caches: list, layers: int) -> list[tuple]:
    """Cache tuples for successive calls: call k, layer i reads caches[(k * layers + i) % n]."""
    n = len(caches)
    sets = n // math.gcd(layers, n)
    return [tuple(caches[(k * layers + i) % n] for i in range(layers)) for k in range(sets)]


def call_with_supported_kwargs(fn, *args, **kwargs):
    """Call ``fn`` with the keyword arguments its signature accepts; fail clearly on a missing one."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn(*args, **kwargs)
    accepted = {k: v for k, v in kwargs.items() if k in sig.parameters}
    missing = [p.name for p in params[len(args):]
               if p.default is p.empty and p.kind is not p.VAR_POSITIONAL and p.name not in accepted]
    if missing:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)}{sig} needs {missing}, which this "
                        f"benchmark does not know how to supply (it passes {sorted(kwargs)})")
    return fn(*args, **accepted)


# ---------------------------------------------------------------------------------------------
# FlashInfer from torch
# ---------------------------------------------------------------------------------------------
class FlashInferPeer:
    """BatchMLAPagedAttentionWrapper with CSR metadata built from the same block tables."""

    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self, torch, backend: str):
        import flashinfer
        import flashinfer.mla as fmla

        self.torch = torch
        self.backend = backend
        self.fmla = fmla
        self.version = getattr(flashinfer, "__version__", None)
        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.wrapper = fmla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
        plan_params = inspect.signature(self.wrapper.plan).parameters
        run_params = inspect.signature(self.wrapper.run).parameters
        # 0.7.x prefers plan(metadata=MLAPlanMetadata.csr(...)) and run(query=, kv_cache=); older
        # releases take flat CSR tensors and run(q_nope, q_pe, ckv_cache, kpe_cache).
        self.canonical = ("metadata" in plan_params and hasattr(fmla, "MLAPlanMetadata")
                          and "query" in run_params and "kv_cache" in run_params)
        needed = (["metadata"] if self.canonical else
                  ["qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"])
        needed += ["num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale"]
        missing = [n for n in needed if n not in plan_params]
        run_needed = ["query", "kv_cache"] if self.canonical else ["q_nope", "q_pe", "ckv_cache",
                                                                   "kpe_cache"]
        missing += [f"run.{n}" for n in run_needed if n not in run_params]
        if missing:
            raise RuntimeError(
                f"flashinfer {self.version}: BatchMLAPagedAttentionWrapper has an unexpected "
                f"signature (missing {missing});\n  plan{inspect.signature(self.wrapper.plan)}\n"
                f"  run{inspect.signature(self.wrapper.run)}")
        self.plan_params = plan_params
        self.run_has_out = "out" in run_params

    def plan(self, layout: Layout, device_meta: dict):
        torch = self.torch
        pt = layout.point
        kwargs = dict(num_heads=pt.H, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM,
                      page_size=pt.page_size, causal=pt.q_len > 1, sm_scale=SOFTMAX_SCALE,
                      q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        if self.canonical:
            kwargs["metadata"] = self.fmla.MLAPlanMetadata.csr(
                device_meta["qo_indptr"], device_meta["kv_indptr"], device_meta["kv_indices"],
                device_meta["kv_len_arr"])
            for name, value in (("query_layout", "split"), ("kv_cache_layout", "split")):
                if name in self.plan_params:
                    kwargs[name] = value
        else:
            kwargs.update({k: device_meta[k] for k in ("qo_indptr", "kv_indptr", "kv_indices",
                                                        "kv_len_arr")})
        kwargs = {k: v for k, v in kwargs.items() if k in self.plan_params}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.wrapper.plan(**kwargs)

    def run(self, q_nope, q_pe, ckv, kpe, out=None):
        extra = {"out": out} if (out is not None and self.run_has_out) else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            if self.canonical:
                return self.wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), **extra)
            return self.wrapper.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, **extra)


# ---------------------------------------------------------------------------------------------
# One point
# ---------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, torch, methods: list[str], progress: Progress):
        import jax

        self.args = args
        self.torch = torch
        self.methods = methods
        self.progress = progress
        self.on_gpu = jax.default_backend() in ("gpu", "cuda")
        self.fi_peers: dict[str, FlashInferPeer] = {}
        self.fi_errors: dict[str, str] = {}
        # Slowdown over the floor seen so far for the slow XLA methods (predicts skips).
        self.slowdown: dict[str, float] = {"xla_naive": 15.0, "jax_mla_xla": 60.0}

    # -- helpers --------------------------------------------------------------------------
    def fi_peer(self, backend: str):
        if backend not in self.fi_peers and backend not in self.fi_errors:
            try:
                self.fi_peers[backend] = FlashInferPeer(self.torch, backend)
            except Exception as e:  # noqa: BLE001
                self.fi_errors[backend] = f"{type(e).__name__}: {e}"
        if backend in self.fi_errors:
            raise RuntimeError(self.fi_errors[backend])
        return self.fi_peers[backend]

    def reference(self, q, cache0, layout: Layout):
        """float32 reference output for the first CHECK_REQUESTS requests, and what computed it.

        jax_mla's torch reference (on the GPU through DLPack) where torch imports, else the plain
        gather + einsum formulation in float32 at the highest matmul precision."""
        k = min(layout.point.B, CHECK_REQUESTS)
        try:
            import torch
            del torch
        except Exception:  # noqa: BLE001
            import jax
            import jax.numpy as jnp

            with jax.default_matmul_precision("highest"):
                out = jax.jit(functools.partial(xla_naive_decode, softmax_scale=SOFTMAX_SCALE))(
                    q[:k].astype(jnp.float32), cache0, self.tables[:k], self.lens[:k])
            return np.asarray(out, np.float32), f"float32 XLA gather reference, first {k} requests"
        from jax_mla.reference import reference_from_jax

        out, _ = reference_from_jax(q[:k], cache0, self.tables[:k], self.lens[:k],
                                    softmax_scale=SOFTMAX_SCALE)
        return out.cpu().numpy(), f"float32 torch reference, first {k} requests"

    @staticmethod
    def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
        actual = np.asarray(actual, np.float64)
        expected = np.asarray(expected, np.float64)
        if not np.isfinite(actual).all():
            return float("inf")
        return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-6))

    def check(self, record, method: str, first_rows: np.ndarray) -> bool:
        """Record the error against the reference; False (and an error) when it is too large."""
        if self.ref is None:
            record["errors"][method] = "no reference output to check against; not timed"
            return False
        err = self.rel_err(first_rows, self.ref)
        record[f"{method}_rel_err"] = err
        if not err <= CHECK_TOL:
            record["errors"][method] = (f"output check failed: rel err {err:.3g} > {CHECK_TOL} "
                                        f"against the float32 reference; not timed")
            return False
        return True

    # -- the point ------------------------------------------------------------------------
    def run_point(self, layout: Layout, record: dict) -> None:
        import jax
        import jax.numpy as jnp

        args = self.args
        pt = layout.point
        n_caches = cache_count(layout, args.mem_budget_gib * GIB, args.l2_bytes)
        record["n_caches"] = n_caches
        if n_caches < 1:
            record["skipped"] = (f"one cache is {layout.cache_bytes / GIB:.1f} GiB, over the "
                                 f"--mem-budget-gib {args.mem_budget_gib}")
            return
        if n_caches == 1 and layout.cache_bytes < 4 * args.l2_bytes:
            record["skipped"] = "memory budget allows a single cache, too small to defeat L2"
            return

        self.progress.status(f"filling {n_caches} caches of {layout.cache_bytes / 2**20:.0f} MiB")
        caches = [random_cache(layout.seed * 1000 + i, layout.num_pages, pt.page_size)
                  for i in range(n_caches)]
        qkey = jax.random.PRNGKey(layout.seed + 7)
        q = jax.random.normal(qkey, (pt.B, pt.q_len, pt.H, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
        self.tables = jnp.asarray(layout.tables)
        self.lens = jnp.asarray(layout.lengths)
        jax.block_until_ready((caches, q, self.tables, self.lens))

        self.progress.status("float32 reference")
        try:
            self.ref, record["check_ref"] = self.reference(q, caches[0], layout)
        except Exception as e:  # noqa: BLE001
            self.ref = None
            record["errors"]["reference"] = f"{type(e).__name__}: {e}"

        outputs: dict[str, object] = {}  # full outputs of layer 0 (cache 0), for the bitwise check
        try:
            for method in self.methods:
                if not method_applies(method, pt, args):
                    continue
                self.progress.status(method)
                try:
                    if method == "flashinfer":
                        self.run_flashinfer(layout, q, caches, record, outputs)
                    else:
                        self.run_jax_method(method, layout, q, caches, record, outputs)
                except Exception as e:  # noqa: BLE001
                    record["errors"][method] = f"{type(e).__name__}: {e}"
                    if args.verbose:
                        traceback.print_exc()
                gc.collect()
            self.compare_bitwise(record, outputs)
            name_plan_comparison(record)
        finally:
            outputs.clear()
            del caches, q
            self.tables = self.lens = self.ref = None
            gc.collect()
            if self.torch is not None and self.on_gpu:
                self.torch.cuda.empty_cache()

    # -- jax methods ----------------------------------------------------------------------
    def run_jax_method(self, method, layout: Layout, q, caches, record, outputs):
        import jax
        import jax_mla

        args = self.args
        pt = layout.point
        w = work(layout)
        layers = args.layers if method.startswith("jax_mla") and method != "jax_mla_xla" else args.xla_layers
        plan = None
        if method == "jax_mla_step":
            return self.time_model_step(layout, q, caches, record, outputs)
        if method == "jax_mla_device_plan":
            self.time_device_plan(layout, record)
            # Where the host-planned step is also replayed as a CUDA graph (small batches, where
            # host launches would otherwise dominate both), compare the schedules that way.
            in_graph = "jax_mla_graph" in self.args.methods and method_applies("jax_mla_graph", pt, self.args)
            record["jax_mla_device_plan_in_graph"] = in_graph
            fn = device_planned(decode_with_plan, layers, pt, layout.max_pages,
                                GRAPH_COMPILER_OPTIONS if in_graph else None)
            return self.time_layers(method, fn, layout, q, caches, None, layers, record, outputs)
        if method in ("jax_mla", "jax_mla_graph", "jax_mla_noplan"):
            from jax_mla import backends

            chosen = backends.resolve("auto", backends.platform_of(q))
            record["jax_mla_backend"] = chosen
            if method != "jax_mla_noplan" and chosen != backends.XLA:
                if not hasattr(jax_mla, "plan"):
                    raise RuntimeError("jax_mla.plan is missing: this jax_mla has no GPU planning API")
                plan_kwargs = dict(num_heads=pt.H, q_len=pt.q_len, max_pages=layout.max_pages,
                                   backend=chosen, page_size=pt.page_size)
                make_plan = lambda: call_with_supported_kwargs(  # noqa: E731
                    jax_mla.plan, np.asarray(layout.lengths, np.int32), **plan_kwargs)
                plan = make_plan()
                record["plan_us"] = host_time_us(make_plan, args.plan_repeats)
                record["plan_ready_us"] = host_time_us(lambda: jax.block_until_ready(make_plan()),
                                                       args.plan_repeats)
            backend_arg = chosen if method == "jax_mla_noplan" else "auto"

            def one(query, cache, tables, lens, plan_):
                return jax_mla.decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE,
                                      backend=backend_arg, plan=plan_)
        elif method == "jax_mla_xla":
            def one(query, cache, tables, lens, plan_):
                return jax_mla.decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE,
                                      backend="xla")
        elif method == "xla_naive":
            need = naive_temp_bytes(layout)
            if need > args.naive_mem_gib * GIB:
                record["xla_naive_skip"] = (f"materialises {need / GIB:.1f} GiB > --naive-mem-gib "
                                            f"{args.naive_mem_gib}")
                return

            def one(query, cache, tables, lens, plan_):
                return xla_naive_decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE)
        else:
            raise ValueError(method)

        if method in self.slowdown:
            predicted = w["floor_us"] * 1e-6 * self.slowdown[method] * layers
            if predicted > args.max_call_s:
                record[f"{method}_skip"] = (f"predicted {predicted:.1f} s per call (x"
                                            f"{self.slowdown[method]:.0f} the floor) > --max-call-s")
                return

        options = GRAPH_COMPILER_OPTIONS if method == "jax_mla_graph" else None
        return self.time_layers(method, layered(one, layers, options), layout, q, caches, plan,
                                layers, record, outputs)

    def time_model_step(self, layout: Layout, q, caches, record, outputs):
        """A whole model step of --step-layers decode calls, end to end, planned two ways.

        ``step_host_plan``: every step calls ``jax_mla.plan`` on the host lengths (as a serving
        loop does; it overlaps the previous step's GPU work under async dispatch) and passes the
        plan in. ``step_device_plan``: the step builds its schedule with ``jax_mla.device_plan``.
        Records ``<name>_ms`` per step (and ``<name>_us`` per layer)."""
        import jax_mla

        pt = layout.point
        layers = self.args.step_layers
        lengths = np.asarray(layout.lengths, np.int32)
        planned_step = layered(decode_with_plan, layers)

        def host_planned_step(query, caches_, tables, lens, plan_):
            del plan_
            fresh = jax_mla.plan(lengths, num_heads=pt.H, q_len=pt.q_len, max_pages=layout.max_pages)
            return planned_step(query, caches_, tables, lens, fresh)

        device_step = device_planned(decode_with_plan, layers, pt, layout.max_pages)
        record["step_layers"] = layers
        for name, fn in (("step_host_plan", host_planned_step), ("step_device_plan", device_step)):
            self.time_layers(name, fn, layout, q, caches, None, layers, record, outputs)
            if record.get(f"{name}_us") is not None:
                record[f"{name}_ms"] = record[f"{name}_us"] * layers / 1e3
        if all(f"{n}_ms" in record for n in ("step_host_plan", "step_device_plan")):
            record["methods_done"].append("jax_mla_step")

    def time_device_plan(self, layout: Layout, record: dict, calls: int = 128, steps: int = 10):
        """The jax_mla.device_plan kernel's time, two ways, from a jitted step of ``calls``
        planner calls, each on its own lengths array and each schedule returned (so no other
        kernel runs), replayed as a CUDA graph:

        - ``device_plan_us``: the kernel alone, the median duration of its launches in a profiler
          trace of 3 steps (CUPTI, as Nsight Systems sees it);
        - ``device_plan_graph_us``: wall time per call over ``steps`` steps back to back (the GPU,
          ~1 ms per step, outruns the host's dispatch), median of 7 rounds: the kernel plus what
          its node in XLA's CUDA graph adds (on the H200 7.8-10.4 µs around a 6.7 µs kernel).
          Without profiler events device_plan_us falls back to this."""
        import jax
        import jax.numpy as jnp
        import jax_mla

        pt = layout.point
        lens = [jnp.asarray(np.roll(layout.lengths, i), jnp.int32) for i in range(calls)]

        def planners(*all_lens):
            return tuple(jax_mla.device_plan(x, num_heads=pt.H, q_len=pt.q_len,
                                             max_pages=layout.max_pages).int_workspace
                         for x in all_lens)

        fn = jax.jit(planners, compiler_options=GRAPH_COMPILER_OPTIONS)
        jax.block_until_ready(fn(*lens))
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            out = [fn(*lens) for _ in range(steps)]
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) / (steps * calls))
            del out
        record["device_plan_graph_us"] = median(samples) * 1e6

        def three_steps():
            for _ in range(3):
                jax.block_until_ready(fn(*lens))

        durations, skip = profiled_kernel_us(three_steps, "PlanKernel")
        record["device_plan_kernel_launches"] = len(durations)
        if skip:
            record["device_plan_kernel_skip"] = skip
        record["device_plan_us"] = median(durations) if durations else record["device_plan_graph_us"]

    def time_layers(self, method, fn, layout: Layout, q, caches, plan, layers, record, outputs):
        import jax

        args = self.args
        pt = layout.point
        w = work(layout)
        sets = rotation_sets(caches, layers)
        call_args = [(q, s, self.tables, self.lens, plan) for s in sets]
        t0 = time.perf_counter()
        first = fn(*call_args[0])
        jax.block_until_ready(first)
        record[f"{method}_first_call_s"] = time.perf_counter() - t0  # compile + one call
        k = min(pt.B, CHECK_REQUESTS)
        ok = self.check(record, method, np.asarray(first[0][:k].astype(np.float32)))
        if method == "jax_mla":
            outputs["jax_mla"] = first[0]
        del first
        if not ok:
            return
        per_layer_s, rounds = time_jax(fn, call_args, layers, args)
        us = per_layer_s * 1e6
        record[f"{method}_us"] = us
        record[f"{method}_rounds"] = rounds
        record[f"{method}_layers"] = layers
        record["methods_done"].append(method)
        if method in self.slowdown and w["floor_us"] >= 50:
            self.slowdown[method] = max(2.0, us / w["floor_us"])
        if method == "jax_mla":
            record["jax_mla_tflops"] = w["flops"] / per_layer_s / 1e12
            record["jax_mla_tbps"] = w["bytes"] / per_layer_s / 1e12
            record["jax_mla_frac_floor"] = w["floor_us"] / us

    # -- flashinfer -----------------------------------------------------------------------
    def run_flashinfer(self, layout: Layout, q, caches, record, outputs):
        torch = self.torch
        if torch is None or not self.on_gpu:
            raise RuntimeError("flashinfer needs torch with CUDA and a JAX GPU backend")
        import jax

        args = self.args
        pt = layout.point
        w = work(layout)
        layers = args.layers
        dev = "cuda"
        meta = {
            "qo_indptr": torch.arange(pt.B + 1, dtype=torch.int32, device=dev) * pt.q_len,
            "kv_indptr": torch.from_numpy(layout.kv_indptr).to(dev),
            "kv_indices": torch.from_numpy(layout.kv_indices).to(dev),
            "kv_len_arr": torch.from_numpy(layout.lengths.astype(np.int32)).to(dev),
        }
        jax.block_until_ready((q, caches))
        q_t = torch.from_dlpack(q)
        q_nope = q_t[..., :KV_LORA_RANK].reshape(pt.B * pt.q_len, pt.H, KV_LORA_RANK).contiguous()
        q_pe = q_t[..., KV_LORA_RANK:].reshape(pt.B * pt.q_len, pt.H, ROPE_DIM).contiguous()
        views = []
        for c in caches:
            t = torch.from_dlpack(c)
            views.append((t[..., :KV_LORA_RANK], t[..., KV_LORA_RANK:]))
        outs = [torch.empty(pt.B * pt.q_len, pt.H, KV_LORA_RANK, dtype=torch.bfloat16, device=dev)
                for _ in range(layers)]
        n = len(views)
        n_sets = n // math.gcd(layers, n)
        best = None
        try:
            for backend in args.fi_backends:
                name = f"flashinfer_{backend}"
                self.progress.status(f"{name}: plan (JIT build on first use)")
                try:
                    peer = self.fi_peer(backend)
                    peer.plan(layout, meta)
                    torch.cuda.synchronize()

                    def replan(peer=peer):
                        peer.plan(layout, meta)
                        torch.cuda.synchronize()

                    record[f"{name}_plan_us"] = host_time_us(replan, args.plan_repeats)
                    out0 = peer.run(q_nope, q_pe, *views[0], out=outs[0]).view(
                        pt.B, pt.q_len, pt.H, KV_LORA_RANK)
                    torch.cuda.synchronize()
                    k = min(pt.B, CHECK_REQUESTS)
                    ok = self.check(record, name, out0[:k].float().cpu().numpy())
                    outputs[name] = out0.clone()
                    if not ok:
                        continue
                    counter = [0]

                    def eager(peer=peer):
                        base = (counter[0] % n_sets) * layers
                        counter[0] += 1
                        for i in range(layers):
                            peer.run(q_nope, q_pe, *views[(base + i) % n], out=outs[i])

                    self.progress.status(f"{name}: timing")
                    per_layer_s, how = time_torch(eager, layers, args, torch)
                    record[f"{name}_us"] = per_layer_s * 1e6
                    record["flashinfer_timer"] = how
                    if best is None or per_layer_s * 1e6 < record[f"flashinfer_{best}_us"]:
                        best = backend
                    if args.fi_graph:
                        self.progress.status(f"{name}: CUDA graph")
                        try:
                            record[f"{name}_graph_us"] = self.time_graph(
                                peer, q_nope, q_pe, views, outs, layers, n_sets) * 1e6
                        except Exception as e:  # noqa: BLE001
                            record["errors"][f"{name}_graph"] = f"{type(e).__name__}: {e}"
                except Exception as e:  # noqa: BLE001
                    record["errors"][name] = f"{type(e).__name__}: {e}"
                    if args.verbose:
                        traceback.print_exc()
            if best is not None:
                us = record[f"flashinfer_{best}_us"]
                record["flashinfer_torch_us"] = us
                record["flashinfer_torch_backend"] = best
                record["flashinfer_plan_us"] = record.get(f"flashinfer_{best}_plan_us")
                record["flashinfer_tflops"] = w["flops"] / (us * 1e-6) / 1e12
                record["flashinfer_tbps"] = w["bytes"] / (us * 1e-6) / 1e12
                graphs = [record[f"flashinfer_{b}_graph_us"] for b in args.fi_backends
                          if record.get(f"flashinfer_{b}_graph_us") is not None]
                if graphs:
                    record["flashinfer_graph_us"] = min(graphs)
                record["methods_done"].append("flashinfer")
        finally:
            torch.cuda.synchronize()  # the views, outputs and metadata die with this frame

    def time_graph(self, peer, q_nope, q_pe, views, outs, layers, n_sets):
        """Seconds per layer of the same runs replayed from one CUDA graph (no Python per call)."""
        torch = self.torch
        n = len(views)
        # Each replay reads every copy once, in the same cyclic order as the eager runs (a replay
        # that stopped part-way through the cycle would re-read a copy still in L2).
        total = n * math.ceil(layers / n)
        del n_sets
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for j in range(min(total, 2 * layers)):
                peer.run(q_nope, q_pe, *views[j % n], out=outs[j % layers])
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(total):
                peer.run(q_nope, q_pe, *views[j % n], out=outs[j % layers])
        torch.cuda.synchronize()
        per_layer_s, _ = time_torch(graph.replay, total, self.args, torch)
        del graph
        return per_layer_s

    def compare_bitwise(self, record, outputs):
        """jax_mla against FlashInfer-torch on the same cache, same backend when both ran."""
        if "jax_mla" not in outputs:
            return
        chosen = record.get("jax_mla_backend")
        name = f"flashinfer_{chosen}" if f"flashinfer_{chosen}" in outputs else next(
            (k for k in outputs if k.startswith("flashinfer_")), None)
        if name is None:
            return
        torch = self.torch
        import jax

        mine = torch.from_dlpack(jax.block_until_ready(outputs["jax_mla"]))
        theirs = outputs[name]
        record["jax_mla_vs_flashinfer_peer"] = name
        record["jax_mla_vs_flashinfer_max_abs_diff"] = float(
            (mine.float() - theirs.float()).abs().max().item())
        record["jax_mla_vs_flashinfer_bitwise"] = bool(torch.equal(mine, theirs))
        del mine


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke run: xla backends only, the tiny 'dry' grid, short timings")
    p.add_argument("--grid", default=None,
                   help=f"one of {sorted(GRIDS)} (default full; dry with --dry-run), or a piece of "
                        "one: full:2/4 is piece 2 of 4 of the full grid")
    p.add_argument("--piece", default=None, metavar="K/N",
                   help="run the K-th of N pieces of similar estimated time (e.g. 1/4)")
    p.add_argument("--points", action="append", default=[], metavar="SPEC",
                   help="keep points matching SPEC, e.g. 'B=128,L=4k|16k,H=16' (repeatable, ';' = or)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--fi-backends", default=",".join(FI_BACKENDS),
                   help="FlashInfer backends to time (flashinfer_torch_us is the faster one)")
    p.add_argument("--no-fi-graph", dest="fi_graph", action="store_false",
                   help="skip the CUDA-graph replay timing of FlashInfer")
    p.add_argument("--out", default=None, help="JSON file (merged by point key); default "
                   "benchmarks/results/<date>-<gpu>.json")
    p.add_argument("--copy-to", default=None, metavar="DIR",
                   help="also copy the JSON into DIR after every point (e.g. $OUT on the GPU machine)")
    p.add_argument("--overwrite", action="store_true", help="re-measure points already in --out")
    p.add_argument("--mem-budget-gib", type=float, default=60.0,
                   help="GPU memory for the rotated caches of one point; bigger points are skipped")
    p.add_argument("--naive-mem-gib", type=float, default=24.0,
                   help="skip xla_naive where its gathered cache + logits exceed this")
    p.add_argument("--layers", type=int, default=12,
                   help="decode calls per jitted step (jax_mla, flashinfer)")
    p.add_argument("--step-layers", type=int, default=61,
                   help="decode calls in jax_mla_step's whole model step (DeepSeek-V3: 61)")
    p.add_argument("--xla-layers", type=int, default=2, help="decode calls per step for the XLA methods")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per JAX measurement (median)")
    p.add_argument("--round-s", type=float, default=0.05, help="target seconds per timed round")
    p.add_argument("--max-method-s", type=float, default=4.0,
                   help="cap on the timing loop of one measurement (a slower call is timed once)")
    p.add_argument("--max-call-s", type=float, default=10.0,
                   help="skip an XLA method whose predicted call time exceeds this")
    p.add_argument("--plan-repeats", type=int, default=9, help="host timings of plan() (median)")
    p.add_argument("--do-bench-warmup-ms", type=float, default=25.0)
    p.add_argument("--do-bench-rep-ms", type=float, default=100.0)
    p.add_argument("--noplan-everywhere", action="store_true",
                   help="time jax_mla_noplan on every point, not only B<=128, L<=4k, q=1, page 64")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="stop starting points after this many seconds (rerun to continue)")
    p.add_argument("--l2-mb", type=float, default=L2_BYTES / 1e6,
                   help="L2 size the cache rotation must defeat (2x of it between reuses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the points and pieces, run nothing")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)

    if args.dry_run:
        args.grid = args.grid or "dry"
        args.layers = min(args.layers, 2)
        args.xla_layers = min(args.xla_layers, 2)
        args.rounds = min(args.rounds, 3)
        args.round_s = min(args.round_s, 0.01)
        args.max_method_s = min(args.max_method_s, 0.2)
        args.plan_repeats = min(args.plan_repeats, 3)
        args.l2_mb = min(args.l2_mb, 0.25)  # a few caches: exercise rotation, not a CPU cache study
    args.grid = args.grid or "full"
    if ":" in args.grid:  # --grid full:2/4 is --grid full --piece 2/4
        args.grid, args.piece = args.grid.split(":", 1)
    args.l2_bytes = args.l2_mb * 1e6
    if args.grid not in GRIDS:
        p.error(f"--grid must be one of {sorted(GRIDS)}")
    default = DRY_DEFAULT_METHODS if args.dry_run else GPU_DEFAULT_METHODS
    args.methods = [m.strip() for m in (args.backends or ",".join(default)).split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown --backends {bad}; choose from {list(METHODS)}")
    if args.dry_run and any(m in ("flashinfer", "jax_mla_noplan", "jax_mla_device_plan",
                                  "jax_mla_step") for m in args.methods):
        p.error("--dry-run runs the XLA backends only (jax_mla, xla_naive, jax_mla_xla)")
    args.fi_backends = [b.strip() for b in args.fi_backends.split(",") if b.strip()]
    if args.piece:
        try:
            k, n = (int(x) for x in args.piece.split("/"))
            assert 1 <= k <= n
        except (ValueError, AssertionError):
            p.error("--piece must be K/N with 1 <= K <= N")
        args.piece_k, args.piece_n = k, n
    return args


def select_points(args) -> tuple[list[Point], dict[Point, Layout], dict[Point, float]]:
    filters = parse_point_filters(args.points)
    points = [pt for pt in GRIDS[args.grid]() if point_matches(pt, filters)]
    layouts = {pt: make_layout(pt, args.seed) for pt in points}
    costs = {pt: estimate_cost_s(layouts[pt], args.methods, args) for pt in points}
    if args.piece:
        points = split_pieces(points, costs, args.piece_n)[args.piece_k - 1]
    else:
        points = sorted(points, key=lambda q: (costs[q], q))
    return points, layouts, costs


def default_out(env: dict, dry_run: bool) -> str:
    date = datetime.date.today().isoformat()
    if dry_run:
        tag = "cpu-dryrun"
    else:
        gpu = (env.get("gpu") or "gpu").lower()
        tag = next((t for t in ("h200", "h100", "b200", "a100") if t in gpu), gpu.split()[-1])
    return os.path.join(REPO, "benchmarks", "results", f"{date}-{tag}.json")


def summary_line(record: dict) -> str:
    parts = []
    for name, field in (("jax_mla", "jax_mla_us"), ("graph", "jax_mla_graph_us"),
                        ("noplan", "jax_mla_noplan_us"),
                        ("devplan", "jax_mla_device_plan_us"), ("planner", "device_plan_us"),
                        ("planner-node", "device_plan_graph_us"),
                        ("step-host", "step_host_plan_ms"), ("step-dev", "step_device_plan_ms"),
                        ("FI", "flashinfer_torch_us"), ("FI-graph", "flashinfer_graph_us"),
                        ("naive", "xla_naive_us"), ("jax_mla_xla", "jax_mla_xla_us")):
        if record.get(field) is not None:
            parts.append(f"{name} {record[field]:.1f}{field.rsplit('_', 1)[1]}")
    parts.append(f"floor {record['floor_us']:.1f}us")
    if record.get("jax_mla_us") and record.get("flashinfer_torch_us"):
        parts.append(f"jax/FI {record['jax_mla_us'] / record['flashinfer_torch_us']:.3f}")
    if record.get("skipped"):
        parts.append(f"SKIPPED: {record['skipped']}")
    if record.get("errors"):
        parts.append(f"errors: {', '.join(sorted(record['errors']))}")
    return "  ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        # JAX and torch share the GPU: let both allocate on demand (see ../shared/gpu/README.md).
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)

    points, layouts, costs = select_points(args)
    if args.list:
        total = sum(costs[p] for p in points)
        print(f"grid {args.grid}{' piece ' + args.piece if args.piece else ''}: {len(points)} points, "
              f"estimated {total / 60:.1f} min")
        for pt in points:
            lay = layouts[pt]
            w = work(lay)
            n = cache_count(lay, args.mem_budget_gib * GIB, args.l2_bytes)
            print(f"  {pt.label:32s} est {costs[pt]:6.1f}s  floor {w['floor_us']:9.1f}us  "
                  f"{n:3d} caches x {lay.cache_bytes / 2**20:9.1f} MiB")
        if args.grid == "full" and not args.piece:
            for n in (2, 3, 4, 6):
                loads = [sum(costs[p] for p in piece) for piece in split_pieces(points, costs, n)]
                print(f"  --piece K/{n}: estimated minutes per piece "
                      + ", ".join(f"{x / 60:.1f}" for x in loads))
        return 0

    torch = None
    if not args.dry_run:
        try:
            import torch  # noqa: F811  (imported before jax allocates anything)
        except Exception as e:  # noqa: BLE001
            print(f"warning: torch unavailable ({e}); flashinfer and the reference check are off",
                  file=sys.stderr)
    import jax

    if not args.dry_run:
        if jax.default_backend() not in ("gpu", "cuda"):
            print("error: no JAX GPU backend; use --dry-run on a CPU machine", file=sys.stderr)
            return 2
        if any(m in args.methods for m in ("jax_mla", "jax_mla_noplan")):
            import jax_mla

            if jax_mla.available_backends() == ["xla"]:
                from jax_mla import backends
                why = backends.gpu_runtime_missing() or "no fa3/fa2 support on this GPU"
                print(f"error: jax_mla's GPU backends are unavailable here ({why}); jax_mla would "
                      f"silently run its XLA backend. Fix that, or pass --backends without jax_mla.",
                      file=sys.stderr)
                return 2
        if "flashinfer" in args.methods and (torch is None or not torch.cuda.is_available()):
            print("error: flashinfer needs torch with CUDA", file=sys.stderr)
            return 2

    env = environment(args.dry_run, torch)
    out_path = args.out or default_out(env, args.dry_run)
    data = load_results(out_path)
    if data.get("env") and data["env"].get("gpu") not in (None, env["gpu"]):
        print(f"warning: {out_path} holds results from {data['env'].get('gpu')}, this is "
              f"{env['gpu']}", file=sys.stderr)
    data["env"] = env
    run_info = {"started": env["date"], "grid": args.grid, "piece": args.piece,
                "methods": args.methods, "points": args.points, "argv": sys.argv[1:],
                "commit": env["commit"]}
    data["runs"].append(run_info)

    existing = {r["key"]: r for r in data["records"]}
    todo = []
    for pt in points:
        old = existing.get(pt.key)
        wanted = {m for m in args.methods
                  if method_applies(m, pt, args)}
        if old and not args.overwrite:
            settled = set(old.get("methods_done", [])) | {m for m in wanted if old.get(f"{m}_skip")}
            if old.get("skipped") or wanted <= settled:
                continue
        todo.append(pt)
    skipped_done = len(points) - len(todo)
    if skipped_done:
        print(f"{skipped_done} point(s) already in {out_path}; skipping them (--overwrite re-measures)",
              file=sys.stderr)

    progress = Progress(sum(costs[p] for p in todo), len(todo))
    bench = Bench(args, torch, args.methods, progress)
    print(f"{len(todo)} point(s), grid {args.grid}{' piece ' + args.piece if args.piece else ''}, "
          f"methods {','.join(args.methods)}, on {env['gpu']} -> {out_path}", file=sys.stderr)
    left = []
    for i, pt in enumerate(todo, 1):
        if args.time_limit and progress.elapsed() + costs[pt] > args.time_limit:
            left = todo[i - 1:]
            break
        layout = layouts[pt]
        progress.begin(i, pt.label)
        record = {"key": pt.key, **dataclasses.asdict(pt), "seed": layout.seed,
                  "max_pages": layout.max_pages, "num_pages": layout.num_pages,
                  "cache_bytes": layout.cache_bytes, "layers": args.layers, **work(layout),
                  "methods_done": [], "errors": {}, "measured": datetime.datetime.now(
                      datetime.timezone.utc).isoformat(timespec="seconds")}
        t0 = time.perf_counter()
        try:
            bench.run_point(layout, record)
        except Exception as e:  # noqa: BLE001 - keep the other points
            record["errors"]["point"] = f"{type(e).__name__}: {e}"
            if args.verbose:
                traceback.print_exc()
        record["wall_s"] = time.perf_counter() - t0
        merge_record(data, record)
        run_info["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        save_results(out_path, data, args.copy_to)
        progress.end(costs[pt], summary_line(record))
    if left:
        print(f"time limit reached: {len(left)} point(s) left ({', '.join(p.label for p in left[:4])}"
              f"{'...' if len(left) > 4 else ''}); rerun the same command to continue", file=sys.stderr)
    run_info["left"] = [p.key for p in left]
    save_results(out_path, data, args.copy_to)
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
