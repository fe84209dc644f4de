"""sm90 beside fa3: a markdown table from benchmark JSON files that timed both.

    python -m benchmarks.sm90_table benchmarks/results/h200-sm90-full.json [MORE.json ...]

Per point: the floor, fa3 from torch replayed as one CUDA graph per step (FlashInfer's own wrapper,
the fairest fa3 number), fa3 called eagerly from torch, sm90 through ``jax_mla.decode`` in a
jitted multi-layer step, their ratio (bold), both shares of the floor and sm90's error against the
float32 reference. Points are sorted by heads, query tokens, page size, batch and length; the last
line counts the points where sm90 is faster than fa3.
"""

from __future__ import annotations

import json
import sys

from benchmarks.grid import fmt_len

COLUMNS = ["H", "q_len", "page", "B", "L", "floor µs", "fa3 graph µs", "fa3 eager µs", "sm90 µs",
           "sm90 / fa3 graph", "fa3 % of floor", "sm90 % of floor", "sm90 error"]


def rows(records: list[dict]) -> list[list[str]]:
    """One row per record with both an sm90 and an fa3 graph time, sorted."""
    out = []
    for r in sorted(records, key=lambda r: (r["H"], r["q_len"], r["page_size"], r["B"], r["L"])):
        sm90, fa3 = r.get("jax_mla_sm90_us"), r.get("flashinfer_fa3_graph_us")
        if sm90 is None or fa3 is None:
            continue
        floor = r["floor_us"]
        out.append([str(r["H"]), str(r["q_len"]), str(r["page_size"]), str(r["B"]), fmt_len(r["L"]),
                    f"{floor:.1f}", f"{fa3:,.1f}", f"{r['flashinfer_fa3_us']:,.1f}", f"{sm90:,.1f}",
                    f"**{sm90 / fa3:.2f}**", f"{100 * floor / fa3:.0f}%", f"{100 * floor / sm90:.0f}%",
                    f"{r['jax_mla_sm90_rel_err']:.1e}"])
    return out


def table(records: list[dict]) -> str:
    body = rows(records)
    faster = sum(float(row[9].strip("*")) < 1.0 for row in body)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    lines += ["", f"sm90 is faster than fa3 (graph) at {faster} of these {len(body)} points."]
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    records = []
    for path in paths:
        with open(path) as f:
            records += json.load(f)["records"]
    print(table(records))


if __name__ == "__main__":
    main(sys.argv[1:])
