"""sm90 beside fa3: a markdown table from benchmark JSON files that timed both.

    python -m benchmarks.sm90_table benchmarks/results/h200-sm90-full.json [MORE.json ...]
    python -m benchmarks.sm90_table --summary benchmarks/results/h200-sm90-gpu-time.json

Per point: the floor, fa3 from torch replayed as one CUDA graph per step (FlashInfer's own wrapper,
the fairest fa3 number), fa3 called eagerly from torch, sm90 through ``jax_mla.decode`` in a
jitted multi-layer step, their ratio (bold), both shares of the floor and sm90's error against the
float32 reference; where sm90 also ran on the fp8 cache (jax_mla_sm90_fp8),
its time, its ratio to sm90 on the bf16 cache and its share of the fp8 cache's floor. Points are
sorted by heads, query tokens, page size, batch and length; the last line counts the points where
sm90 is faster than fa3. Where the benchmark also recorded the GPU's busy time per layer of the
jitted steps (``jax_mla_sm90_gpu_us``: the wall clock less the GPU's waits for the host between
calls, which fa3's graph replays leave out too), three more columns set that time beside fa3's
graph, and the fp8 columns add the fp8 cache's. Where FlashInfer also ran on its own fp8 cache
(flashinfer_fp8), a second table sets sm90 on the fp8 cache beside it: times, and each output's
relative L2 distance from the bf16 cache's float32 reference.

``--summary`` prints the README's short table instead: the points of SUMMARY_POINTS (pages of 64),
each row by one measure, the GPU's busy time where recorded, else the wall clock (its last column
says which).

``--ranges`` prints the ranges that the reports' bullets quote: per heads, q_len, batch and
length class (below 4k tokens, from 4k), over both page sizes, the span of sm90's ratio to fa3's
graph by busy time (the wall clock in brackets), its and fa3's shares of the floor, and the fp8
cache's ratio to the bf16 cache and its share of the fp8 floor.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.grid import fmt_len
from benchmarks.report import markdown_table

COLUMNS = ["H", "q_len", "page", "B", "L", "floor µs", "fa3 graph µs", "fa3 eager µs", "sm90 µs",
           "sm90 / fa3 graph", "fa3 % of floor", "sm90 % of floor", "sm90 error"]
FP8_COLUMNS = ["sm90 fp8 µs", "fp8 / bf16", "fp8 % of fp8 floor"]
GPU_COLUMNS = ["sm90 GPU µs", "sm90 GPU / fa3 graph", "sm90 GPU % of floor"]
FP8_GPU_COLUMNS = ["sm90 fp8 GPU µs", "fp8 / bf16 GPU", "fp8 GPU % of fp8 floor"]


def _ratio_cells(us, reference_us, floor_us) -> list[str]:
    """A time, its ratio to ``reference_us`` (bold) and the share of the floor it reaches ("-"
    where not measured)."""
    if us is None or reference_us is None:
        return ["-"] * 3
    return [f"{us:,.1f}", f"**{us / reference_us:.2f}**", f"{100 * floor_us / us:.0f}%"]


def gpu_cells(r: dict) -> list[str]:
    """sm90's GPU busy time per layer, against fa3's graph and the floor."""
    return _ratio_cells(r.get("jax_mla_sm90_gpu_us"), r.get("flashinfer_fa3_graph_us"),
                        r["floor_us"])


def fp8_gpu_cells(r: dict) -> list[str]:
    """sm90's GPU busy time per layer on the fp8 cache, against the bf16 cache's, and its share of
    the fp8 floor."""
    return _ratio_cells(r.get("jax_mla_sm90_fp8_gpu_us"), r.get("jax_mla_sm90_gpu_us"),
                        r.get("fp8_floor_us"))


def fp8_cells(r: dict) -> list[str]:
    """The fp8 columns of a record ("-" where sm90 did not run on the fp8 cache)."""
    return _ratio_cells(r.get("jax_mla_sm90_fp8_us"), r.get("jax_mla_sm90_us"),
                        r.get("fp8_floor_us"))


def _in_point_order(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r["H"], r["q_len"], r["page_size"], r["B"], r["L"]))


def _point_cells(r: dict) -> list[str]:
    """A record's H, q_len, page, B and L cells."""
    return [str(r["H"]), str(r["q_len"]), str(r["page_size"]), str(r["B"]), fmt_len(r["L"])]


def rows(records: list[dict], with_fp8: bool = False, with_gpu: bool = False) -> list[list[str]]:
    """One row per record with both an sm90 and an fa3 graph time, sorted; ``with_gpu`` adds the
    GPU busy time's columns, ``with_fp8`` the fp8 columns (and with ``with_gpu`` theirs)."""
    out = []
    for r in _in_point_order(records):
        sm90, fa3 = r.get("jax_mla_sm90_us"), r.get("flashinfer_fa3_graph_us")
        if sm90 is None or fa3 is None:
            continue
        floor = r["floor_us"]
        out.append(_point_cells(r) + [
            f"{floor:.1f}", f"{fa3:,.1f}", f"{r['flashinfer_fa3_us']:,.1f}", f"{sm90:,.1f}",
            f"**{sm90 / fa3:.2f}**", f"{100 * floor / fa3:.0f}%", f"{100 * floor / sm90:.0f}%",
            f"{r['jax_mla_sm90_rel_err']:.1e}"]
            + (gpu_cells(r) if with_gpu else [])
            + (fp8_cells(r) if with_fp8 else [])
            + (fp8_gpu_cells(r) if with_fp8 and with_gpu else []))
    return out


FI_FP8_COLUMNS = ["H", "q_len", "page", "B", "L", "fp8 floor µs", "sm90 bf16 µs", "sm90 fp8 µs",
                  "fa3 fp8 group µs", "fa3 fp8 tensor µs", "sm90 fp8 / fa3 fp8",
                  "L2 vs bf16: sm90 fp8", "fa3 fp8 group", "fa3 fp8 tensor"]
FI_FP8 = ("flashinfer_fa3_fp8_group", "flashinfer_fa3_fp8_tensor")


def _us(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def fp8_rows(records: list[dict]) -> list[list[str]]:
    """One row per record where sm90 ran on the fp8 cache and fa3 on its own fp8 cache."""
    out = []
    for r in _in_point_order(records):
        ours = r.get("jax_mla_sm90_fp8_us")
        theirs = [r.get(f"{name}_graph_us") for name in FI_FP8]
        if ours is None or all(t is None for t in theirs):
            continue
        fastest = min(t for t in theirs if t is not None)
        out.append(_point_cells(r) + [
            f"{r['fp8_floor_us']:.1f}", _us(r.get("jax_mla_sm90_us")), _us(ours),
            *(_us(t) for t in theirs), f"**{ours / fastest:.2f}**",
            _percent(r.get("jax_mla_sm90_fp8_vs_bf16_l2")),
            *(_percent(r.get(f"{name}_vs_bf16_l2")) for name in FI_FP8)])
    return out


def fp8_table(records: list[dict]) -> str:
    """sm90 on the fp8 cache beside fa3 on FlashInfer's ("" where none ran both)."""
    body = fp8_rows(records)
    if not body:
        return ""
    lines = markdown_table(FI_FP8_COLUMNS, body)
    faster = sum(float(row[10].strip("*")) < 1.0 for row in body)
    lines += ["", f"sm90 on the fp8 cache is faster than fa3's faster fp8 layout at {faster} of "
                  f"these {len(body)} points."]
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    with_fp8 = any("jax_mla_sm90_fp8_us" in r for r in records)
    with_gpu = any("jax_mla_sm90_gpu_us" in r for r in records)
    body = rows(records, with_fp8, with_gpu)
    faster = sum(float(row[9].strip("*")) < 1.0 for row in body)
    columns = (COLUMNS + (GPU_COLUMNS if with_gpu else []) + (FP8_COLUMNS if with_fp8 else [])
               + (FP8_GPU_COLUMNS if with_fp8 and with_gpu else []))
    lines = markdown_table(columns, body)
    lines += ["", f"sm90 is faster than fa3 (graph) at {faster} of these {len(body)} points."]
    if with_gpu:
        ratios = [row[len(COLUMNS) + 1].strip("*") for row in body]
        faster_gpu = sum(x != "-" and float(x) < 1.0 for x in ratios)
        lines[-1] += f" By the GPU's busy time: at {faster_gpu} of them."
    return "\n".join(lines)


# (H, q_len, B, L) of the summary: issue 14's targets at 16 and 128 heads, and B = 512.
SUMMARY_POINTS = [(16, 1, 32, 16384), (16, 1, 128, 4096), (16, 1, 128, 16384), (16, 1, 512, 16384),
                  (16, 2, 32, 16384), (16, 2, 128, 4096), (128, 1, 32, 4096), (128, 1, 32, 16384),
                  (128, 1, 128, 4096), (128, 1, 128, 16384), (128, 1, 512, 4096)]
SUMMARY_COLUMNS = ["H", "q_len", "B", "L", "floor µs", "fa3 µs", "sm90 µs", "sm90 / fa3",
                   "sm90 % of floor", "sm90 fp8 µs", "fp8 / bf16", "fp8 % of fp8 floor", "time"]


def summary_times(r: dict) -> tuple[float | None, float | None, str]:
    """sm90's time on the bf16 and the fp8 cache (None where not measured) by one measure: the
    GPU's busy time where the bf16 time has it, else the wall clock; and which ("busy", "wall")."""
    if r.get("jax_mla_sm90_gpu_us") is not None:
        return r["jax_mla_sm90_gpu_us"], r.get("jax_mla_sm90_fp8_gpu_us"), "busy"
    return r.get("jax_mla_sm90_us"), r.get("jax_mla_sm90_fp8_us"), "wall"


def summary_rows(records: list[dict]) -> list[list[str]]:
    """One row per SUMMARY_POINTS point measured with pages of 64 beside fa3's graph replay (of
    several records of a point, the last): fa3, sm90 on the bf16 cache beside it and on the fp8
    cache beside that, in SUMMARY_POINTS' order."""
    by_point = {(r["H"], r["q_len"], r["B"], r["L"]): r for r in records
                if r["page_size"] == 64 and r.get("flashinfer_fa3_graph_us") is not None}
    out = []
    for point in SUMMARY_POINTS:
        r = by_point.get(point)
        if r is None:
            continue
        bf16, fp8, measure = summary_times(r)
        if bf16 is None:
            continue
        fa3, floor, fp8_floor = r["flashinfer_fa3_graph_us"], r["floor_us"], r.get("fp8_floor_us")
        out.append([str(r["H"]), str(r["q_len"]), str(r["B"]), fmt_len(r["L"]), f"{floor:,.1f}",
                    f"{fa3:,.1f}", *_ratio_cells(bf16, fa3, floor),
                    *_ratio_cells(fp8 if fp8_floor is not None else None, bf16, fp8_floor),
                    measure])
    return out


def summary(records: list[dict]) -> str:
    """The README's short table of sm90 beside fa3 (summary_rows), as markdown lines."""
    return "\n".join(markdown_table(SUMMARY_COLUMNS, summary_rows(records)))


RANGE_COLUMNS = ["H", "q_len", "B", "L", "points", "sm90 / fa3 graph, busy (wall)",
                 "sm90 % of floor, busy", "fa3 % of floor", "fp8 / bf16, busy (wall)",
                 "fp8 % of fp8 floor, busy"]


def _span(values: list, fmt: str) -> str:
    """"lo-hi" of the values that are not None, each formatted by fmt; one value where both
    format alike; "-" where there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


def _ratios(records: list[dict], numerator: str, denominator: str) -> list:
    return [None if r.get(numerator) is None or r.get(denominator) is None
            else r[numerator] / r[denominator] for r in records]


def _share_span(records: list[dict], floor: str, time: str) -> str:
    """The span of 100 floor / time over the records that have both, as "lo-hi%"."""
    span = _span([None if x is None else 100 / x for x in _ratios(records, time, floor)], "{:.0f}")
    return span if span == "-" else span + "%"


def range_rows(records: list[dict]) -> list[list[str]]:
    """One row per (H, q_len, B, length class) of the records with an sm90 and an fa3 graph time
    (of several records of a point, the last), sorted by those four: the spans over the group's
    points (both page sizes) of each measure RANGE_COLUMNS names."""
    by_point = {(r["H"], r["q_len"], r["page_size"], r["B"], r["L"]): r for r in records
                if r.get("jax_mla_sm90_us") is not None
                and r.get("flashinfer_fa3_graph_us") is not None}
    groups: dict[tuple, list[dict]] = {}
    for r in by_point.values():
        groups.setdefault((r["H"], r["q_len"], r["B"], r["L"] >= 4096), []).append(r)
    out = []
    for (heads, q_len, batch, long), group in sorted(groups.items()):
        busy = _span(_ratios(group, "jax_mla_sm90_gpu_us", "flashinfer_fa3_graph_us"), "{:.2f}")
        wall = _span(_ratios(group, "jax_mla_sm90_us", "flashinfer_fa3_graph_us"), "{:.2f}")
        fp8_busy = _span(_ratios(group, "jax_mla_sm90_fp8_gpu_us", "jax_mla_sm90_gpu_us"),
                         "{:.2f}")
        fp8_wall = _span(_ratios(group, "jax_mla_sm90_fp8_us", "jax_mla_sm90_us"), "{:.2f}")
        out.append([str(heads), str(q_len), str(batch), "from 4k" if long else "below 4k",
                    str(len(group)), f"{busy} ({wall})",
                    _share_span(group, "floor_us", "jax_mla_sm90_gpu_us"),
                    _share_span(group, "floor_us", "flashinfer_fa3_graph_us"),
                    "-" if fp8_wall == "-" else f"{fp8_busy} ({fp8_wall})",
                    _share_span(group, "fp8_floor_us", "jax_mla_sm90_fp8_gpu_us")])
    return out


def ranges(records: list[dict]) -> str:
    """The ranges the reports' bullets quote (range_rows), as markdown lines."""
    return "\n".join(markdown_table(RANGE_COLUMNS, range_rows(records)))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sm90_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", action="store_true", help="the README's short table")
    parser.add_argument("--ranges", action="store_true", help="the ranges the bullets quote")
    parser.add_argument("files", nargs="+", metavar="FILE.json")
    args = parser.parse_args(argv)
    records = []
    for path in args.files:
        with open(path) as f:
            records += json.load(f)["records"]
    if args.summary:
        print(summary(records))
        return
    if args.ranges:
        print(ranges(records))
        return
    print(table(records))
    extra = fp8_table(records)
    if extra:
        print("\n" + extra)


if __name__ == "__main__":
    main(sys.argv[1:])
