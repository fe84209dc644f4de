"""The GPU planner's schedule, built by its sequential host twin (same per-tile code as the kernel):
every invariant FlashInfer's fa3/fa2 `run` relies on, and balance against FlashInfer's MLAPlan."""

from __future__ import annotations

import ctypes
import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_TVM_FFI

from benchmarks import grid, problem
from jax_mla import gpu, planning

NUM_SM = 132
pytestmark = pytest.mark.skipif(not HAS_TVM_FFI, reason="the FFI library links TVM-FFI's runtime")


@pytest.fixture(scope="module")
def host_planner(plan_twin_path):
    function = ctypes.CDLL(str(plan_twin_path)).JaxMlaDevicePlanOnHost
    function.restype = ctypes.c_int
    return function


def build(host_planner, lengths, q_len, num_heads, max_pages, num_sm=NUM_SM):
    layout = planning.schedule_layout(num_sm, q_len, num_heads, 512)
    workspace = np.full(layout.int_workspace_bytes, 0xAB, np.uint8)  # poison: every read is written
    lengths = np.ascontiguousarray(lengths, np.int32)
    info = np.asarray(layout.plan_info, np.int64)
    works = host_planner(lengths.ctypes.data_as(ctypes.c_void_p), len(lengths), q_len, num_heads,
                         max_pages, num_sm, int(q_len > 1), info.ctypes.data_as(ctypes.c_void_p),
                         workspace.ctypes.data_as(ctypes.c_void_p))
    return layout, workspace, works


def arrays(layout, workspace, works, num_sm=NUM_SM):
    names = ["q_indptr", "kv_indptr", "partial_indptr", "merge_start", "merge_end",
             "merge_partial_start", "merge_partial_end", "merge_stride", "q_len", "kv_len",
             "q_start", "kv_start", "kv_end", "work_indptr"]
    sizes = [works] * 3 + [num_sm] * 5 + [works] * 5 + [layout.plan_info[1] + 1]
    return {name: np.frombuffer(workspace, np.int32, size, offset)
            for name, size, offset in zip(names, sizes, layout.plan_info[2:16])}


def tile_kv_len(seq_len, q_len, num_heads, tile, tiles, tile_rows):
    """MLAPlan's packed_causal_kv_end."""
    if q_len == 1 or tile + 1 == tiles:
        return seq_len
    return max(min(seq_len - q_len + -(-(tile + 1) * tile_rows // num_heads), seq_len), 0)


def kv_len_limit(total, clusters):
    x = max(-(-total // clusters), 1)
    for bound, limit in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if x <= bound:
            return limit
    return -(-x // 256) * 256


def tiles_of(lengths, q_len, num_heads, cluster_size):
    rows, packed = cluster_size * 64, q_len * num_heads
    tiles = -(-packed // rows)
    for b, seq_len in enumerate(lengths):
        for tile in range(tiles):
            yield b, tile, tile_kv_len(int(seq_len), q_len, num_heads, tile, tiles, rows), \
                min(rows, packed - tile * rows)


def host_mlaplan_makespan(lengths, q_len, num_heads):
    """The busiest cluster's cost under FlashInfer's MLAPlan (min-heap, cost 2*tile_q + kv)."""
    cluster_size = 2 if q_len * num_heads > 64 else 1
    clusters, rows = NUM_SM // cluster_size, cluster_size * 64
    items = list(tiles_of(lengths, q_len, num_heads, cluster_size))
    limit = kv_len_limit(sum(item[2] for item in items), clusters)
    heap = [(0.0, c) for c in range(clusters)]
    for b in range(len(lengths)):  # MLAPlan walks each request's tiles from the last one
        for _, _, remaining, _ in reversed([it for it in items if it[0] == b]):
            while True:
                cost, c = heapq.heappop(heap)
                chunk = min(remaining, limit)
                heapq.heappush(heap, (cost + 2 * rows + chunk, c))
                remaining -= chunk
                if remaining <= 0:
                    break
    return max(cost for cost, _ in heap)


def check_schedule(layout, a, works, lengths, q_len, num_heads, max_pages):
    cluster_size, clusters = layout.plan_info[:2]
    rows = cluster_size * 64
    items = list(tiles_of(lengths, q_len, num_heads, cluster_size))
    limit = kv_len_limit(sum(item[2] for item in items), clusters)
    indptr = a["work_indptr"]
    assert indptr[0] == 0 and np.all(np.diff(indptr) >= 0) and indptr[-1] == works <= 16384

    by_tile = {}
    for w in range(works):
        b = a["q_indptr"][w] // q_len
        assert a["q_indptr"][w] == b * q_len and a["kv_indptr"][w] == b * max_pages
        assert a["q_len"][w] == q_len and a["kv_len"][w] == lengths[b]
        assert a["q_start"][w] % rows == 0
        by_tile.setdefault((b, a["q_start"][w] // rows), []).append(w)

    partial_rows, partial_capacity = set(), 2 * clusters * rows
    merges = []
    for b, tile, remaining, row_tile in items:
        ws = sorted(by_tile.pop((b, tile)), key=lambda w: a["kv_start"][w])
        starts, ends = a["kv_start"][ws], a["kv_end"][ws]
        assert starts[0] == 0 and ends[-1] == remaining and np.all(starts[1:] == ends[:-1])
        assert np.all(ends - starts <= limit)
        split = remaining > limit
        partials = a["partial_indptr"][ws]
        if not split:
            assert len(ws) == 1 and partials[0] == -1
            continue
        base = partials[0]
        assert np.array_equal(partials, base + row_tile * np.arange(len(ws)))
        for p in partials:
            span = set(range(p, p + row_tile))
            assert not span & partial_rows and p + row_tile <= partial_capacity
            partial_rows |= span
        merges.append((b * q_len * num_heads + tile * rows, row_tile, base, len(ws)))
    assert not by_tile, f"works of unknown tiles: {by_tile}"

    count = int(np.count_nonzero(a["merge_end"] - a["merge_start"]))
    assert count <= NUM_SM
    for name in ("merge_start", "merge_end", "merge_partial_start", "merge_partial_end", "merge_stride"):
        assert np.all(a[name][count:] == 0)
    covered = {}
    for m in range(count):
        start, end = a["merge_start"][m], a["merge_end"][m]
        covered[start] = (end, a["merge_partial_start"][m], a["merge_partial_end"][m], a["merge_stride"][m])
    for packed, row_tile, base, chunks in merges:
        offset = 0
        while offset < row_tile:
            end, p_start, p_end, stride = covered.pop(packed + offset)
            assert (p_start, p_end, stride) == (base + offset, base + chunks * row_tile, row_tile)
            offset = end - packed
        assert offset == row_tile
    assert not covered

    costs = [sum(2 * rows + a["kv_end"][w] - a["kv_start"][w] for w in range(indptr[c], indptr[c + 1]))
             for c in range(clusters)]
    return max(costs)


CASES = {
    "one-token": ([1], 1, 128),
    "b1-long": ([32768], 1, 128),
    "b1-mtp": ([5000], 2, 128),
    "all-ones": ([1] * 128, 1, 128),
    "skew": ([32768] + [17] * 127, 1, 128),
    "skew-h16": ([32768] + [17] * 127, 1, 16),
    "b32-4k-mtp": (list(np.random.default_rng(0).integers(2048, 6144, 32)), 2, 128),
    "b128-16k-h16": (list(np.random.default_rng(1).integers(8192, 24576, 128)), 1, 16),
    "b512-4k": (list(np.random.default_rng(2).integers(2048, 6144, 512)), 1, 128),
    "b512-1k-mtp-h16": (list(np.random.default_rng(3).integers(512, 1536, 512)), 2, 16),
    # Small-work costs that add up past 2^31: the kernel's block-wide scan carries them in 64 bits.
    # (The planner takes lengths up to planning.MAX_KV_LEN = 2^22.)
    "huge-64bit-costs": ([2**22] * 500 + [2**22 - 7, 2**22 - 1000, 3 * 2**20] * 10, 1, 128),
}
# Benchmark points where one fixed way of balancing lost to MLAPlan under its cost model
# (docs/gpu-schedule.md): (B, L, H, q_len) with the benchmark's own lengths.
BENCH_CASES = [(32, 32768, 128, 2), (32, 32768, 128, 1), (128, 16384, 16, 2), (128, 4096, 16, 1),
               (32, 16384, 16, 1)]


def bench_lengths(batch, mean_len, num_heads, q_len):
    point = grid.Point(B=batch, L=mean_len, H=num_heads, q_len=q_len, page_size=64)
    return list(problem.make_layout(point, 0).lengths)


for _b, _l, _h, _q in BENCH_CASES:
    CASES[f"bench-b{_b}-{_l // 1024}k-h{_h}-q{_q}"] = (functools.partial(bench_lengths, _b, _l, _h, _q),
                                                        _q, _h)


def with_spare_page(lengths):
    """(int32 lengths, a block-table width with one spare page)."""
    lengths = np.asarray(lengths, np.int32)
    return lengths, int(-(-lengths.max() // 64)) + 1


def case_inputs(case):
    """CASES[case] as (int32 lengths, q_len, num_heads, max_pages with one spare page)."""
    lengths, q_len, num_heads = CASES[case]
    lengths, max_pages = with_spare_page(lengths() if callable(lengths) else lengths)
    return lengths, q_len, num_heads, max_pages


def checked_makespans(host_planner, lengths, q_len, num_heads, max_pages):
    """(the twin's busiest cluster, MLAPlan's) under MLAPlan's cost model, once check_schedule
    has found the twin's schedule complete and consistent."""
    layout, workspace, works = build(host_planner, lengths, q_len, num_heads, max_pages)
    assert works > 0
    makespan = check_schedule(layout, arrays(layout, workspace, works), works, lengths, q_len,
                              num_heads, max_pages)
    return makespan, host_mlaplan_makespan(lengths, q_len, num_heads)


@pytest.mark.parametrize("case", CASES)
def test_schedule_is_complete_and_balanced(host_planner, case):
    makespan, reference = checked_makespans(host_planner, *case_inputs(case))
    assert makespan <= 1.07 * reference, (makespan, reference)


# The planner goal's grid: q_len 1, the benchmark's lengths (uniform in [L/2, 3L/2]).
GOAL_GRID = [(b, l, h) for h in (16, 128) for b in (1, 32, 128, 512) for l in (1024, 4096, 16384)]


@pytest.mark.parametrize("batch,mean_len,num_heads", GOAL_GRID)
def test_goal_grid_busiest_cluster_within_2_5_percent_of_mlaplans(host_planner, batch, mean_len,
                                                                   num_heads):
    """Under MLAPlan's cost model. At B=512, H=128 every work is small under every variant, so the
    four variants coincide unless RestShift2 gives them other phases."""
    lengths, max_pages = with_spare_page(bench_lengths(batch, mean_len, num_heads, 1))
    makespan, reference = checked_makespans(host_planner, lengths, 1, num_heads, max_pages)
    assert makespan <= 1.025 * reference, (makespan / reference)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_kernel_writes_the_host_twins_schedule(host_planner, case):
    """The kernel (threads walking item ranges, warp-parallel budgets and layout, shared-memory
    atomics) and its sequential twin share integer math, so every schedule word must be equal."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    num_sm = gpu.sm_count()  # the twin plans for this GPU's SM count, whatever it is
    lengths, q_len, num_heads, max_pages = case_inputs(case)
    layout, workspace, works = build(host_planner, lengths, q_len, num_heads, max_pages, num_sm)
    on_gpu = np.asarray(planning.device_plan(jnp.asarray(lengths), num_heads=num_heads,
                                             max_pages=max_pages, q_len=q_len).int_workspace)
    by_gpu = arrays(layout, on_gpu, works, num_sm)
    for name, expected in arrays(layout, workspace, works, num_sm).items():
        np.testing.assert_array_equal(by_gpu[name], expected, err_msg=name)


@pytest.mark.parametrize("q_len,num_heads", [(1, 128), (2, 16), (4, 128)])
def test_bad_lengths_are_planned_as_their_clamped_values(host_planner, q_len, num_heads):
    """The planner reads a length clamped to [0, MAX_KV_LEN]: the schedule of bad lengths is, byte
    for byte, the schedule of the clamped ones (so it stays inside the workspace like them)."""
    lengths = np.array([5, -3, 2**31 - 1, 0, 700, -(2**31), 2**22 + 5, 64, 1], np.int64)
    clamped = np.clip(lengths, 0, planning.MAX_KV_LEN)
    _, bad, bad_works = build(host_planner, lengths.astype(np.int32), q_len, num_heads, max_pages=9)
    _, good, good_works = build(host_planner, clamped.astype(np.int32), q_len, num_heads, max_pages=9)
    assert bad_works == good_works >= 1 and bad.tobytes() == good.tobytes()


def test_checker_catches_a_broken_schedule(host_planner):
    lengths = np.asarray(CASES["b512-4k"][0], np.int32)
    layout, workspace, works = build(host_planner, lengths, 1, 128, 100)
    a = arrays(layout, workspace, works)
    a["kv_end"][3] -= 1  # a gap in one tile's kv range
    with pytest.raises(AssertionError):
        check_schedule(layout, a, works, lengths, 1, 128, 100)


def test_device_plan_lowers_to_one_graph_safe_custom_call(monkeypatch):
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: NUM_SM)
    monkeypatch.setattr(gpu, "register_targets", lambda: None)
    lengths = jax.ShapeDtypeStruct((512,), jnp.int32)
    text = jax.jit(lambda sl: planning.device_plan(sl, num_heads=128, max_pages=64, q_len=2)
                   .int_workspace).trace(lengths).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "@jax_mla_device_plan(" in line)
    layout = planning.schedule_layout(NUM_SM, 2, 128, 512)
    assert "causal = true" in call and "num_heads = 128" in call and "max_pages = 64" in call
    assert f"sm_count = {NUM_SM}" in call
    assert f"tensor<{layout.int_workspace_bytes}xui8>" in call
    with pytest.raises(ValueError, match="may exceed FlashInfer's 16384 scheduled works"):
        planning.device_plan(jnp.zeros((9000,), jnp.int32), num_heads=128, max_pages=4, q_len=2)


def test_device_plan_rejects_more_clusters_than_the_kernel_holds(monkeypatch):
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 2 * 257)
    with pytest.raises(ValueError, match=r"at most 256 clusters, this GPU has 257 \(514 SMs\); "
                                         r"use jax_mla.plan"):
        planning.device_plan(jnp.zeros((4,), jnp.int32), num_heads=128, max_pages=4)

