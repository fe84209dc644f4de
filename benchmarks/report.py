"""Turn ``python -m benchmarks.decode`` results into a markdown report and a roofline plot.

    python -m benchmarks.report benchmarks/results/h200-decode.json
    python -m benchmarks.report a.json b.json --md report.md --png roofline.png

Several JSON files are merged by point key (later files win). The markdown holds the environment,
a verdict for each goal of benchmarks/goals.toml computed from the data, the full table, and what
was skipped or failed. The PNG plots achieved TFLOP/s against arithmetic intensity under the
roofline of the floor model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import os
import sys
import tomllib

from benchmarks.grid import fmt_len
from benchmarks.problem import FLOOR_MODELS
from benchmarks.results import load_merged

GOALS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goals.toml")

# Method -> (column holding µs per layer, label in plot and text).
METHODS = {
    "jax_mla": ("jax_mla_us", "jax_mla (auto + plan, jit)"),
    "flashinfer": ("flashinfer_torch_us", "FlashInfer from torch (eager)"),
    "flashinfer_graph": ("flashinfer_graph_us", "FlashInfer from torch (CUDA graph)"),
    "xla_naive": ("xla_naive_us", "plain XLA (gather + einsum)"),
    "jax_mla_xla": ("jax_mla_xla_us", "jax_mla backend='xla'"),
}


def peaks(env: dict) -> tuple[float, float]:
    """The floor model's FLOP/s and bytes/s the run recorded (runs before it did: the H200's)."""
    default = FLOOR_MODELS[0]
    return (env.get("peak_flops") or default.flops_per_s,
            env.get("peak_bytes_per_s") or default.bytes_per_s)


def label(r: dict) -> str:
    return f"H={r['H']} B={r['B']} L={fmt_len(r['L'])} q={r['q_len']} p={r['page_size']}"


def num(r: dict, field: str):
    v = r.get(field)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def ratio(a, b):
    return a / b if a is not None and b else None


def f(v, digits=1, suffix=""):
    if v is None:
        return "–"
    if abs(v) >= 1000 and digits <= 1:
        return f"{v:,.0f}{suffix}"
    return f"{v:.{digits}f}{suffix}"


# ---------------------------------------------------------------------------------------------
# Goals (benchmarks/goals.toml), checked against the data
# ---------------------------------------------------------------------------------------------
OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
BOUNDS = {"at_most": "<=", "below": "<", "at_least": ">="}


@dataclasses.dataclass
class Goal:
    title: str
    numerator: list[str]
    denominator: str | None
    bound_op: str
    bound: float
    format: str
    scope: dict[str, tuple[str, float]]
    scope_has: list[str]
    explain: list[str]

    @classmethod
    def from_entry(cls, entry: dict) -> "Goal":
        numerator = entry["numerator"]
        numerator = [numerator] if isinstance(numerator, str) else list(numerator)
        (bound_key,) = [k for k in BOUNDS if k in entry]
        scope = {}
        for field, condition in entry.get("scope", {}).items():
            op, value = condition.split()
            if op not in OPS:
                raise ValueError(f"goal {entry['title']!r}: unknown comparison {op!r} in scope")
            scope[field] = (op, float(value))
        denominator = entry.get("denominator")
        return cls(entry["title"], numerator, denominator, BOUNDS[bound_key], float(entry[bound_key]),
                   entry.get("format", "{:.3g}"), scope, list(entry.get("scope_has", [])),
                   list(entry.get("explain", numerator + ([denominator] if denominator else []))))

    @property
    def formula(self) -> str:
        top = " or ".join(self.numerator)
        top = f"({top})" if len(self.numerator) > 1 else top
        return f"{top}{' / ' + self.denominator if self.denominator else ''} {self.bound_op} {self.bound:g}"

    def in_scope(self, r: dict) -> bool:
        return (all(field in r and OPS[op](r[field], value) for field, (op, value) in self.scope.items())
                and (not self.scope_has or any(field in r for field in self.scope_has)))

    def value(self, r: dict):
        top = next((num(r, field) for field in self.numerator if num(r, field) is not None), None)
        return ratio(top, num(r, self.denominator)) if self.denominator else top

    def met(self, v: float) -> bool:
        return OPS[self.bound_op](v, self.bound)

    def show(self, v: float) -> str:
        return self.format.format(v)


def load_goals(path: str = GOALS) -> list[Goal]:
    with open(path, "rb") as fh:
        return [Goal.from_entry(entry) for entry in tomllib.load(fh)["goal"]]


def why_missing(r: dict, *fields: str) -> str:
    reasons = []
    if r.get("skipped"):
        return f"point skipped: {r['skipped']}"
    for field in fields:
        if num(r, field) is None:
            method = field[:-3]
            base = {"flashinfer_torch": "flashinfer"}.get(method, method)
            reason = (r.get(f"{base}_skip") or (r.get("errors") or {}).get(base)
                      or (r.get("errors") or {}).get(f"{base}_fa3") or "not run")
            reasons.append(f"{field}: {reason}")
    return "; ".join(reasons) or "?"


def verdict(goal: Goal, rows) -> dict:
    """Where ``goal`` is met, where not, and where its value is unmeasured, over ``rows``."""
    scope = [r for r in rows if goal.in_scope(r)]
    measured = [(r, goal.value(r)) for r in scope if goal.value(r) is not None]
    unmeasured = [r for r in scope if goal.value(r) is None]
    passed = [(r, v) for r, v in measured if goal.met(v)]
    failed = [(r, v) for r, v in measured if not goal.met(v)]
    if not scope:
        text = "NOT MEASURED: no point of the grid is in scope"
    elif not measured:
        text = f"NOT MEASURED: {len(scope)} point(s) in scope, none with both numbers"
    elif not failed:
        text = f"MET at all {len(measured)} measured point(s)"
    elif not passed:
        text = f"NOT MET at any of the {len(measured)} measured point(s)"
    else:
        text = f"NOT MET at {len(failed)} of {len(measured)} measured point(s) (met at {len(passed)})"
    if measured and unmeasured:
        text += f"; {len(unmeasured)} in-scope point(s) unmeasured"
    lines = []
    groups: dict[tuple, list] = {}
    for r, v in measured:
        groups.setdefault((r["H"], r["q_len"], r["page_size"]), []).append((r, v))
    for (h, q, p), items in sorted(groups.items()):
        ok = sum(1 for _, v in items if goal.met(v))
        vals = [v for _, v in items]
        lines.append(f"H={h} q={q} page={p}: met at {ok}/{len(items)}, range "
                     f"{goal.show(min(vals))} .. {goal.show(max(vals))}")
    details = {
        "met": [f"{label(r)} ({goal.show(v)})" for r, v in passed],
        "not met": [f"{label(r)} ({goal.show(v)})" for r, v in failed],
        "unmeasured": [f"{label(r)} ({why_missing(r, *goal.explain)})" for r in unmeasured],
    }
    return {"title": f"{goal.title} ({goal.formula})", "verdict": text, "groups": lines,
            "details": details, "n_met": len(passed), "n_failed": len(failed),
            "n_unmeasured": len(unmeasured)}


def goals(rows, goals_path: str = GOALS) -> list[dict]:
    return [verdict(goal, rows) for goal in load_goals(goals_path)]


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------
def max_rel_err(r: dict):
    errs = [v for k, v in r.items() if k.endswith("_rel_err") and isinstance(v, (int, float))]
    return max(errs) if errs else None


def markdown_table(head: list[str], cell_rows) -> list[str]:
    """Lines of a markdown table: the header, its rule, one line per row of cells."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(str(c) for c in cells) + " |" for cells in cell_rows])


def table(rows) -> list[str]:
    head = ["H", "q", "page", "B", "L", "floor µs", "jax_mla µs", "backend", "FI-torch µs", "FI backend",
            "jax/FI", "jax graph µs", "FI graph µs", "plain XLA µs", "× plain XLA", "jax_mla xla µs", "noplan µs",
            "devplan µs", "planner µs", "plan µs", "FI plan µs", "% of floor", "TFLOP/s", "TB/s", "FI TFLOP/s", "max rel err",
            "jax=FI bits"]
    cell_rows = []
    for r in rows:
        jm, fi = num(r, "jax_mla_us"), num(r, "flashinfer_torch_us")
        naive = num(r, "xla_naive_us")
        frac = num(r, "jax_mla_frac_floor")
        bitwise = r.get("jax_mla_vs_flashinfer_bitwise")
        diff = num(r, "jax_mla_vs_flashinfer_max_abs_diff")
        bits = "–" if bitwise is None else ("yes" if bitwise else f"no ({diff:.2g})")
        err = max_rel_err(r)
        cells = [r["H"], r["q_len"], r["page_size"], r["B"], fmt_len(r["L"]), f(num(r, "floor_us")),
                 f(jm), r.get("jax_mla_backend", "–"), f(fi), r.get("flashinfer_torch_backend", "–"),
                 f(ratio(jm, fi), 3), f(num(r, "jax_mla_graph_us")), f(num(r, "flashinfer_graph_us")),
                 f(naive) if naive is not None else ("skip" if r.get("xla_naive_skip") else "–"),
                 f(ratio(naive, jm), 1, "x"),
                 f(num(r, "jax_mla_xla_us")) if num(r, "jax_mla_xla_us") is not None else
                 ("skip" if r.get("jax_mla_xla_skip") else "–"),
                 f(num(r, "jax_mla_noplan_us")), f(num(r, "jax_mla_device_plan_us")),
                 f(num(r, "device_plan_us")), f(num(r, "plan_us")), f(num(r, "flashinfer_plan_us")),
                 f(frac * 100 if frac is not None else None, 0, "%"), f(num(r, "jax_mla_tflops"), 1),
                 f(num(r, "jax_mla_tbps"), 2), f(num(r, "flashinfer_tflops"), 1),
                 "–" if err is None else f"{err:.1e}", bits]
        if r.get("skipped"):
            cells[6] = "skipped"
        cell_rows.append(cells)
    # Columns of methods no point measured are left out.
    keep = [i for i in range(len(head)) if i < 7 or any(cells[i] != "–" for cells in cell_rows)]
    return markdown_table([head[i] for i in keep], [[cells[i] for i in keep] for cells in cell_rows])


def schedule_table(rows) -> list[str]:
    """Host vs device schedule, per layer, and the planners' own costs."""
    picked = [r for r in rows if num(r, "run_with_device_plan_us") is not None]
    if not picked:
        return []
    head = ["H", "q", "B", "L", "floor µs", "run, host plan µs", "run, device plan µs", "device/host",
            "step with planner µs/layer", "GPU planner µs", "planner's graph node µs", "host plan() µs"]
    out = ["## Host schedule vs GPU schedule", "",
           "µs per layer of one jitted step of N layers sharing one schedule. **run, device plan** "
           "takes the planner's share (its graph node's µs / N) out of the device-planned step "
           "(**step with planner**), so device/host compares the schedules. The planner is timed "
           "apart, in steps of 128 planner calls replayed as CUDA graphs: **GPU planner µs** is "
           "the kernel alone (median launch in a profiler trace), **planner's graph node µs** the "
           "wall time per call with the steps replayed back to back (the kernel plus what a node "
           "of XLA's graph adds). Where jax_mla_graph was timed (B <= 32), both steps were "
           "replayed as CUDA graphs (host launches would otherwise set both times); elsewhere "
           "neither was.", ""]
    cell_rows = []
    for r in picked:
        host, dev = num(r, "run_with_host_plan_us"), num(r, "run_with_device_plan_us")
        cell_rows.append([
            r["H"], r["q_len"], r["B"], fmt_len(r["L"]), f(num(r, "floor_us")), f(host), f(dev),
            f(ratio(dev, host), 3), f(num(r, "jax_mla_device_plan_us")), f(num(r, "device_plan_us")),
            f(num(r, "device_plan_graph_us")), f(num(r, "plan_ready_us"))])
    return out + markdown_table(head, cell_rows) + [""]


def step_table(rows) -> list[str]:
    """Whole model steps (jax_mla_step), end to end, host plan every step vs device plan, each
    with the guard of bad values (the default) and without it."""
    picked = [r for r in rows if num(r, "step_device_plan_ms") is not None]
    if not picked:
        return []
    head = ["H", "q", "B", "L", "layers", "step, host plan ms", "step, device plan ms", "device/host",
            "host plan, unguarded ms", "device plan, unguarded ms", "guarded/unguarded - 1, host plan",
            "guarded/unguarded - 1, device plan", "interleaved, host plan",
            "interleaved, device plan", "guard alone µs, lengths only",
            "guard alone µs, with a plan", "guard with a plan / step", "host plan() µs"]
    out = ["## Whole decode step, host plan vs GPU plan, with and without the guard", "",
           "One jitted step of all layers, steps dispatched back to back. Host plan: "
           "`jax_mla.plan(lengths)` runs on the host before every step (overlapping the previous "
           "step's GPU work) and is passed in; device plan: `jax_mla.device_plan` inside the step. "
           "Unguarded: `decode(..., fail_closed=False)`; interleaved: the median of guarded / "
           "unguarded over rounds run alternately (less exposed to drift than the two medians), "
           "its quartiles in brackets. "
           "The guard alone: one step's guard "
           "(`jax_mla.guard`), timed as 64 independent guards in one jitted program; lengths only "
           "(what `plan=\"device\"`, `plan=None` and the backends without a plan run) and with a "
           "plan (also rewrites the plan's works: what both steps here run, as both pass a Plan "
           "to every layer); its share is the larger over the two unguarded steps.",
           ""]
    cell_rows = []
    for r in picked:
        host, dev = num(r, "step_host_plan_ms"), num(r, "step_device_plan_ms")
        host_open, dev_open = num(r, "step_host_plan_unguarded_ms"), num(r, "step_device_plan_unguarded_ms")
        cell_rows.append([
            r["H"], r["q_len"], r["B"], fmt_len(r["L"]), r.get("step_layers", "–"), f(host, 2),
            f(dev, 2), f(ratio(dev, host), 3), f(host_open, 2), f(dev_open, 2),
            percent_over(host, host_open), percent_over(dev, dev_open),
            ratio_with_quartiles(r, "step_host_plan_guard_ratio"),
            ratio_with_quartiles(r, "step_device_plan_guard_ratio"), f(num(r, "guard_us"), 2),
            f(num(r, "guard_plan_us"), 2), guard_share(r), f(num(r, "plan_ready_us"))])
    return out + markdown_table(head, cell_rows) + [""]


def guard_share(r) -> str:
    """The guard alone over the unguarded step it runs in. Both steps pass a Plan to every layer,
    so their guard rewrites the plan's works (``guard_plan_us``); the larger share is shown."""
    shares = [num(r, "guard_plan_us") / (1e3 * num(r, step))
              for step in ("step_device_plan_unguarded_ms", "step_host_plan_unguarded_ms")
              if num(r, "guard_plan_us") is not None and num(r, step)]
    return f"{100 * max(shares):.2f}%" if shares else "–"


def ratio_with_quartiles(r, key: str) -> str:
    """``ratio_percent`` of ``r[key]``, followed by its quartiles ``r[key + "_quartiles"]`` in
    brackets where the record has them."""
    q = r.get(key + "_quartiles")
    text = ratio_percent(num(r, key))
    return text if not q else f"{text} [{ratio_percent(q[0])}, {ratio_percent(q[1])}]"


def ratio_percent(ratio) -> str:
    """A ratio ``r`` as ``r - 1`` in signed percent, or "–"."""
    return "–" if ratio is None else f"{100 * (ratio - 1):+.2f}%"


def percent_over(value, base) -> str:
    """``value / base - 1`` as a signed percentage, or "–"."""
    if value is None or not base:
        return "–"
    return f"{100 * (value / base - 1):+.2f}%"


def markdown(env: dict, rows: list[dict], png_name: str | None, sources: list[str],
             goals_path: str = GOALS) -> str:
    lines = ["# MLA decode benchmark" + (f": {env.get('gpu')}" if env.get("gpu") else ""), ""]
    if env.get("dry_run"):
        lines += ["> **CPU dry run.** These numbers exercise the benchmark script on the XLA "
                  "backends with tiny shapes; they are not performance data and say nothing "
                  "about the goals on a GPU.", ""]
    lines += ["| | |", "|---|---|"]
    for k in ("gpu", "driver", "cuda", "jax", "jaxlib", "jax_cuda_plugin", "torch", "flashinfer",
              "triton", "commit", "date", "python"):
        lines.append(f"| {k} | {env.get(k, '–') if env.get(k) is not None else '–'} |")
    lines.append(f"| sources | {', '.join(os.path.basename(s) for s in sources)} |")
    if env.get("note"):
        lines.append(f"| note | {env['note']} |")
    peak_flops, peak_bytes = peaks(env)
    lines += ["", f"Floor per layer: max(FLOPs / {peak_flops / 1e12:.0f} TFLOP/s, bytes / "
              f"{peak_bytes / 1e12:.1f} TB/s), FLOPs = 2·(576+512)·H·q·Σlen, bytes = Σlen·576·2 + "
              "B·q·H·(576+512)·2. Every time is µs per decode call (one layer), median.", ""]

    lines += ["## Goals (computed from the data)", ""]
    for g in goals(rows, goals_path):
        lines.append(f"- **{g['title']}**: {g['verdict']}.")
        for text in g["groups"]:
            lines.append(f"  - {text}")
        for kind in ("not met", "unmeasured"):
            items = g["details"][kind]
            if items:
                shown = items[:12]
                more = f" … and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
                lines.append(f"  - {kind}: " + "; ".join(shown) + more)
    lines.append("")

    lines += ["## Results", ""]
    lines += table(rows)
    lines.append("")
    lines += schedule_table(rows) + step_table(rows)
    if png_name:
        lines += [f"![roofline]({png_name})", ""]

    notes = []
    for r in rows:
        bits = []
        if r.get("skipped"):
            bits.append(f"skipped: {r['skipped']}")
        for m in ("xla_naive", "jax_mla_xla"):
            if r.get(f"{m}_skip"):
                bits.append(f"{m} skipped: {r[f'{m}_skip']}")
        for m, e in sorted((r.get("errors") or {}).items()):
            bits.append(f"{m} error: {e}")
        if bits:
            notes.append(f"- {label(r)}: " + "; ".join(bits))
    if notes:
        lines += ["## Skipped and failed", ""] + notes + [""]

    lines += ["## Columns", "",
              "- **jax_mla µs**: `jax_mla.decode(backend=\"auto\", plan=jax_mla.plan(...))` inside "
              "`jax.jit`, N layers per call, each layer reading another cache copy; µs per layer. "
              "**backend** is what \"auto\" picked.",
              "- **FI-torch µs**: FlashInfer's `BatchMLAPagedAttentionWrapper.run()` called from torch "
              "(eager, plan excluded), the faster of the FlashInfer backends timed "
              "(**FI backend**); **FI graph µs**: the same runs replayed from one CUDA graph.",
              "- **jax/FI**: jax_mla µs / FI-torch µs (below 1: jax_mla faster). **jax graph µs**: "
              "jax_mla's step compiled with XLA command buffers forced on (`xla_gpu_enable_command_buffer"
              "=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL`, `xla_gpu_graph_min_graph_size=1`), so the "
              "whole step replays as CUDA graphs; B <= 32.",
              "- **plain XLA µs**: gather pages with the block table, einsum, masked softmax, einsum "
              "(what a JAX user writes today); **× plain XLA**: plain XLA µs / jax_mla µs.",
              "- **jax_mla xla µs**: `jax_mla.decode(backend=\"xla\")`, the chunked pure-XLA backend.",
              "- **noplan µs**: jax_mla without a plan (plans inside each call; small sub-grid).",
              "- **devplan µs**: jax_mla with its schedule built on the GPU inside the jitted step "
              "(`jax_mla.device_plan`, once, shared by the layers); **planner µs**: that planner "
              "kernel alone (median launch duration in a profiler trace).",
              "- **plan µs** / **FI plan µs**: host time of `jax_mla.plan(...)` / of FlashInfer's "
              "`plan()` (+ synchronize), median; once per step, shared by all layers.",
              "- **% of floor**: floor µs / jax_mla µs. **TFLOP/s**, **TB/s**: jax_mla's achieved "
              "rates with the FLOPs and bytes above; **FI TFLOP/s** likewise for FI-torch.",
              "- **max rel err**: largest max|out − ref| / max|ref| of any method against a float32 "
              "torch reference (first requests of the batch), checked before timing.",
              "- **jax=FI bits**: whether jax_mla's output equals FlashInfer-torch's bit for bit "
              "(same backend where both ran), else the max abs difference.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Roofline plot
# ---------------------------------------------------------------------------------------------
def roofline(env: dict, rows: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"warning: no PNG ({e}); pip install matplotlib", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
    peak_flops, peak_bytes = peaks(env)
    ridge = peak_flops / peak_bytes
    xs = [0.5, ridge, 2000]
    ax.plot(xs, [min(peak_flops, x * peak_bytes) / 1e12 for x in xs], color="black", lw=1.5,
            label=f"roofline ({peak_flops / 1e12:.0f} TFLOP/s, {peak_bytes / 1e12:.1f} TB/s)")
    markers = {"jax_mla": ("o", "C0"), "flashinfer": ("x", "C1"), "flashinfer_graph": ("+", "C2"),
               "xla_naive": ("s", "C3"), "jax_mla_xla": ("^", "C4")}
    ys_all = []
    for method, (field, name) in METHODS.items():
        pts = [(r["intensity"], r["flops"] / (r[field] * 1e-6) / 1e12) for r in rows
               if num(r, field) and num(r, "flops") and num(r, "intensity")]
        if not pts:
            continue
        marker, color = markers[method]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color,
                   label=f"{name} ({len(pts)})", s=28, alpha=0.8,
                   facecolors="none" if marker in ("o", "s", "^") else None)
        ys_all += [p[1] for p in pts]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of ideal traffic)")
    ax.set_ylabel("achieved TFLOP/s")
    low = min(ys_all + [1.0]) / 2
    ax.set_ylim(max(low, 1e-6), peak_flops / 1e12 * 2)
    ax.set_xlim(0.5, 2000)
    title = f"MLA decode roofline: {env.get('gpu', '?')}"
    if env.get("dry_run"):
        title += " (CPU dry run: not performance data)"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="results of benchmarks.decode (merged by key)")
    p.add_argument("--md", default=None, help="markdown output (default: first JSON with .md)")
    p.add_argument("--png", default=None,
                   help="roofline PNG (default: first JSON with .png; 'none': no plot)")
    p.add_argument("--goals", default=GOALS, help="the goals to check (default benchmarks/goals.toml)")
    p.add_argument("--stdout", action="store_true", help="also print the markdown")
    args = p.parse_args(argv)
    stem = os.path.splitext(args.json[0])[0]
    md_path = args.md or stem + ".md"
    png_path = args.png or stem + ".png"
    env, rows = load_merged(args.json)
    made_png = args.png != "none" and roofline(env, rows, png_path)
    png_ref = (os.path.relpath(png_path, os.path.dirname(os.path.abspath(md_path)))
               if made_png else None)
    text = markdown(env, rows, png_ref, args.json, args.goals)
    with open(md_path, "w") as fh:
        fh.write(text)
    if args.stdout:
        print(text)
    print(f"wrote {md_path}" + (f" and {png_path}" if made_png else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
