"""Measuring one point: build its problem, check every method against a float32 reference, time it,
and fill the point's record."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
import traceback

import numpy as np

from benchmarks import methods as m
from benchmarks.peers import FlashInferTimer, compare_bitwise
from benchmarks.problem import (FP8_ROW_BYTES, GIB, HEAD_DIM, KV_LORA_RANK, SOFTMAX_SCALE, Layout,
                                cache_count, fp8_errors, naive_temp_bytes, random_cache,
                                relative_error, work)
from benchmarks.progress import Progress
from benchmarks.results import name_plan_comparison
from benchmarks.timing import (gpu_busy_per_layer_us, host_time_us, interleaved_ratios, median,
                               profiled_kernel_us, quartiles, time_jax)

CHECK_REQUESTS = 4  # requests checked against the float32 reference at every point
CHECK_TOL = 2e-2  # max |out - ref| / max |ref| for bf16 outputs
PLANNER_KERNEL = "PlanKernel"
GUARD_RATIO_PAIRS = 25  # alternating rounds behind each guarded / unguarded step ratio


@dataclasses.dataclass
class PointRun:
    """What the methods of one point share: its data on the device and its reference output."""

    layout: Layout
    record: dict
    q: object
    caches: list
    tables: object
    lens: object
    ref: np.ndarray | None = None
    outputs: dict = dataclasses.field(default_factory=dict)  # layer 0 outputs, for compare_bitwise

    @property
    def checked(self) -> int:
        return min(self.layout.point.B, CHECK_REQUESTS)

    def check(self, method: str, first_rows) -> bool:
        """Record the error against the reference; False (and an error) when it is too large."""
        if self.ref is None:
            self.record["errors"][method] = "no reference output to check against; not timed"
            return False
        err = relative_error(first_rows, self.ref)
        self.record[f"{method}_rel_err"] = err
        if not err <= CHECK_TOL:
            self.record["errors"][method] = (f"output check failed: rel err {err:.3g} > {CHECK_TOL} "
                                             f"against the float32 reference; not timed")
            return False
        return True


def reference(run: PointRun) -> tuple[np.ndarray, str]:
    """float32 reference output for the first CHECK_REQUESTS requests, and what computed it.

    jax_mla's torch reference (on the GPU through DLPack) where torch imports, else the plain
    gather + einsum formulation in float32 at the highest matmul precision."""
    k = run.checked
    args = (run.caches[0], run.tables[:k], run.lens[:k])
    try:
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001
        import jax
        import jax.numpy as jnp

        with jax.default_matmul_precision("highest"):
            out = jax.jit(functools.partial(m.xla_naive_decode, softmax_scale=SOFTMAX_SCALE))(
                run.q[:k].astype(jnp.float32), *args)
        return np.asarray(out, np.float32), f"float32 XLA gather reference, first {k} requests"
    from jax_mla.reference import reference_from_jax

    out, _ = reference_from_jax(run.q[:k], *args, softmax_scale=SOFTMAX_SCALE)
    return out.cpu().numpy(), f"float32 torch reference, first {k} requests"


def time_device_plan(layout: Layout, record: dict, calls: int = 128, steps: int = 10) -> None:
    """The jax_mla.device_plan kernel's time, two ways, from a jitted step of ``calls`` planner
    calls, each on its own lengths array and each schedule returned (so no other kernel runs),
    replayed as a CUDA graph:

    - ``device_plan_us``: the kernel alone, the median duration of its launches in a profiler
      trace of 3 steps (CUPTI, as Nsight Systems sees it);
    - ``device_plan_graph_us``: wall time per call over ``steps`` steps back to back (the GPU
      outruns the host's dispatch), median of 7 rounds: the kernel plus what its node in XLA's
      CUDA graph adds. Without profiler events device_plan_us falls back to this."""
    import jax
    import jax.numpy as jnp
    import jax_mla

    pt = layout.point
    lens = [jnp.asarray(np.roll(layout.lengths, i), jnp.int32) for i in range(calls)]

    def planners(*all_lens):
        return tuple(jax_mla.device_plan(x, num_heads=pt.H, q_len=pt.q_len,
                                         max_pages=layout.max_pages).int_workspace
                     for x in all_lens)

    fn = jax.jit(planners, compiler_options=m.GRAPH_COMPILER_OPTIONS)
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

    durations, skip = profiled_kernel_us(three_steps, PLANNER_KERNEL)
    record["device_plan_kernel_launches"] = len(durations)
    if skip:
        record["device_plan_kernel_skip"] = skip
    record["device_plan_us"] = median(durations) if durations else record["device_plan_graph_us"]


class Bench:
    """Measures points one after another; keeps what outlives a point (the FlashInfer timer with
    its wrappers, the slow XLA methods' slowdown over the floor seen so far)."""

    def __init__(self, args, torch, methods: list[str], progress: Progress):
        import jax

        self.args = args
        self.torch = torch
        self.methods = methods
        self.progress = progress
        self.on_gpu = jax.default_backend() in ("gpu", "cuda")
        self.flashinfer = FlashInferTimer(torch, args, progress) if torch is not None else None
        # Slowdown over the floor seen so far for the slow XLA methods (predicts skips).
        self.slowdown: dict[str, float] = {"xla_naive": 15.0, "jax_mla_xla": 60.0}

    def fail(self, record: dict, what: str, e: Exception) -> None:
        record["errors"][what] = f"{type(e).__name__}: {e}"
        if self.args.verbose:
            traceback.print_exc()

    # -- the point ------------------------------------------------------------------------
    def run_point(self, layout: Layout, record: dict) -> None:
        run = self.prepare(layout, record)
        if run is None:
            return
        try:
            for method in self.methods:
                if not m.method_applies(method, layout.point, self.args):
                    continue
                self.progress.status(method)
                try:
                    if method in ("flashinfer", "flashinfer_fp8"):
                        if self.flashinfer is None or not self.on_gpu:
                            raise RuntimeError("flashinfer needs torch with CUDA and a JAX GPU backend")
                        if method == "flashinfer":
                            self.flashinfer.run(run)
                        else:
                            self.time_flashinfer_fp8(run)
                    else:
                        self.run_jax_method(run, method)
                except Exception as e:  # noqa: BLE001
                    self.fail(record, method, e)
                gc.collect()
            if self.torch is not None:
                compare_bitwise(self.torch, record, run.outputs)
            name_plan_comparison(record)
        finally:
            run.outputs.clear()
            del run
            gc.collect()
            if self.torch is not None and self.on_gpu:
                self.torch.cuda.empty_cache()

    def prepare(self, layout: Layout, record: dict) -> PointRun | None:
        """The point's rotated caches, query and reference; None when the point is skipped."""
        import jax
        import jax.numpy as jnp

        args = self.args
        pt = layout.point
        n_caches = cache_count(layout, args.mem_budget_gib * GIB, args.l2_bytes)
        record["n_caches"] = n_caches
        if n_caches < 1:
            record["skipped"] = (f"one cache is {layout.cache_bytes / GIB:.1f} GiB, over the "
                                 f"--mem-budget-gib {args.mem_budget_gib}")
            return None
        if n_caches == 1 and layout.cache_bytes < 4 * args.l2_bytes:
            record["skipped"] = "memory budget allows a single cache, too small to defeat L2"
            return None

        self.progress.status(f"filling {n_caches} caches of {layout.cache_bytes / 2**20:.0f} MiB")
        caches = [random_cache(layout.seed * 1000 + i, layout.num_pages, pt.page_size)
                  for i in range(n_caches)]
        qkey = jax.random.PRNGKey(layout.seed + 7)
        q = jax.random.normal(qkey, (pt.B, pt.q_len, pt.H, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
        run = PointRun(layout, record, q, caches, jnp.asarray(layout.tables), jnp.asarray(layout.lengths))
        jax.block_until_ready((caches, q, run.tables, run.lens))

        self.progress.status("float32 reference")
        try:
            run.ref, record["check_ref"] = reference(run)
        except Exception as e:  # noqa: BLE001
            record["errors"]["reference"] = f"{type(e).__name__}: {e}"
        return run

    # -- jax methods ----------------------------------------------------------------------
    def run_jax_method(self, run: PointRun, method: str) -> None:
        if method == "jax_mla_step":
            return self.time_model_step(run)
        if method == "jax_mla_device_plan":
            return self.time_device_planned(run)
        if method == "jax_mla_sm90_fp8":
            return self.time_sm90_fp8(run)
        layers = self.args.layers if method in m.JAX_MLA_PLANNED else self.args.xla_layers
        if self.skip_slow(run, method, layers):
            return
        if method == "xla_naive":
            one, plan = _naive_layer, None
        elif method == "jax_mla_xla":
            one, plan = _xla_backend_layer, None
        elif method in ("jax_mla_sm90", "jax_mla_sm90_graph"):
            one, plan = _sm90_backend_layer, None
        else:
            one, plan = self.jax_mla_layer(run, method)
        options = m.GRAPH_COMPILER_OPTIONS if method in m.GRAPH_METHODS else None
        self.time_layers(run, method, m.layered(one, layers, options), plan, layers)

    def skip_slow(self, run: PointRun, method: str, layers: int) -> bool:
        """Whether plain XLA would materialise too much, or a slow XLA method would take too long
        (predicted from its slowdown over the floor so far); the reason goes to ``<method>_skip``."""
        args = self.args
        if method == "xla_naive" and naive_temp_bytes(run.layout) > args.naive_mem_gib * GIB:
            run.record["xla_naive_skip"] = (f"materialises {naive_temp_bytes(run.layout) / GIB:.1f} "
                                            f"GiB > --naive-mem-gib {args.naive_mem_gib}")
            return True
        if method in self.slowdown:
            predicted = (work(run.layout, model=args.floor_model)["floor_us"] * 1e-6
                         * self.slowdown[method] * layers)
            if predicted > args.max_call_s:
                run.record[f"{method}_skip"] = (f"predicted {predicted:.1f} s per call (x"
                                                f"{self.slowdown[method]:.0f} the floor) > --max-call-s")
                return True
        return False

    def jax_mla_layer(self, run: PointRun, method: str):
        """(one layer of jax_mla, the step's plan) for jax_mla, jax_mla_graph and jax_mla_noplan;
        records the backend "auto" chose and, where that backend reads a plan, the host planner's
        time."""
        import jax
        import jax_mla
        from jax_mla import backends

        pt, record = run.layout.point, run.record
        chosen = backends.resolve("auto", backends.platform_of(run.q))
        record["jax_mla_backend"] = chosen
        plan = None
        if method != "jax_mla_noplan" and backends.BY_NAME[chosen].reads_plan == backends.FA_PLAN:
            lengths = np.asarray(run.layout.lengths, np.int32)

            def make_plan():
                return jax_mla.plan(lengths, num_heads=pt.H, q_len=pt.q_len,
                                    max_pages=run.layout.max_pages)

            plan = make_plan()
            record["plan_us"] = host_time_us(make_plan, self.args.plan_repeats)
            record["plan_ready_us"] = host_time_us(lambda: jax.block_until_ready(make_plan()),
                                                   self.args.plan_repeats)
        backend_arg = chosen if method == "jax_mla_noplan" else "auto"

        def one(query, cache, tables, lens, plan_):
            return jax_mla.decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE,
                                  backend=backend_arg, plan=plan_)

        return one, plan

    def time_device_planned(self, run: PointRun) -> None:
        """jax_mla with its schedule built on the GPU inside the step, and the planner alone."""
        time_device_plan(run.layout, run.record)
        pt = run.layout.point
        # Where the host-planned step is also replayed as a CUDA graph (small batches, where
        # host launches would otherwise dominate both), compare the schedules that way.
        in_graph = "jax_mla_graph" in self.args.methods and m.method_applies("jax_mla_graph", pt, self.args)
        run.record["jax_mla_device_plan_in_graph"] = in_graph
        layers = self.args.layers
        fn = m.device_planned(m.decode_with_plan, layers, pt, run.layout.max_pages,
                              m.GRAPH_COMPILER_OPTIONS if in_graph else None)
        self.time_layers(run, "jax_mla_device_plan", fn, None, layers)

    def time_sm90_fp8(self, run: PointRun) -> None:
        """sm90 on fp8 caches quantised from the point's bf16 caches (``write_kv``'s rule), checked
        against the float32 reference on the first of them (the dequantised cache) and timed like
        jax_mla_sm90; records the fp8 cache's floor as ``fp8_floor_us`` and the output's distance
        from the bf16 cache's reference as ``jax_mla_sm90_fp8_vs_bf16_err`` and ``..._l2``."""
        fp8_run = dataclasses.replace(run, caches=[quantized_cache(c) for c in run.caches],
                                      ref=None, outputs={})
        record = run.record
        try:
            fp8_run.ref, record["check_ref_fp8"] = reference(fp8_run)
            fp8_work = work(run.layout, FP8_ROW_BYTES, self.args.floor_model)
            record["fp8_floor_us"] = fp8_work["floor_us"]
            first_rows = self.time_layers(fp8_run, "jax_mla_sm90_fp8",
                                          m.layered(_sm90_backend_layer, self.args.layers), None,
                                          self.args.layers)
            if run.ref is not None:
                record["jax_mla_sm90_fp8_vs_bf16_err"], record["jax_mla_sm90_fp8_vs_bf16_l2"] = (
                    fp8_errors(first_rows, run.ref))
        finally:
            fp8_run.caches.clear()

    def time_flashinfer_fp8(self, run: PointRun) -> None:
        """FlashInfer from torch on its own fp8 cache, made from the point's caches
        (``peers.FlashInferTimer.run_fp8``)."""
        fp8_caches = [quantized_cache(c) for c in run.caches]
        try:
            self.flashinfer.run_fp8(run, fp8_caches)
        finally:
            fp8_caches.clear()

    def time_model_step(self, run: PointRun) -> None:
        """A whole model step of --step-layers decode calls, end to end, planned two ways, each
        with and without the guard of bad values (``fail_closed``).

        ``step_host_plan``: every step calls ``jax_mla.plan`` on the host lengths (as a serving
        loop does; it overlaps the previous step's GPU work under async dispatch) and passes the
        plan in. ``step_device_plan``: the step builds its schedule with ``jax_mla.device_plan``.
        ``*_unguarded``: the same with ``fail_closed=False``. Records ``<name>_ms`` per step (and
        ``<name>_us`` per layer), and ``<name>_guard_ratio``: guarded / unguarded step time, the
        median over GUARD_RATIO_PAIRS rounds run alternately (``timing.interleaved_ratios``), with
        its quartiles in ``<name>_guard_ratio_quartiles``."""
        import jax_mla

        layout, record = run.layout, run.record
        pt = layout.point
        layers = self.args.step_layers
        lengths = np.asarray(layout.lengths, np.int32)
        record["step_layers"] = layers
        steps = {}
        for suffix, guarded in (("", True), ("_unguarded", False)):
            one = functools.partial(m.decode_with_plan, fail_closed=guarded)
            planned_step = m.layered(one, layers)

            def host_planned_step(query, caches_, tables, lens, plan_, planned_step=planned_step):
                del plan_
                fresh = jax_mla.plan(lengths, num_heads=pt.H, q_len=pt.q_len,
                                     max_pages=layout.max_pages)
                return planned_step(query, caches_, tables, lens, fresh)

            steps[f"step_host_plan{suffix}"] = host_planned_step
            steps[f"step_device_plan{suffix}"] = m.device_planned(one, layers, pt, layout.max_pages)
        for name, fn in steps.items():
            self.time_layers(run, name, fn, None, layers)
            if record.get(f"{name}_us") is not None:
                record[f"{name}_ms"] = record[f"{name}_us"] * layers / 1e3
        if all(f"{n}_ms" in record for n in steps):
            record["methods_done"].append("jax_mla_step")
            call_args = [(run.q, s, run.tables, run.lens, None)
                         for s in m.rotation_sets(run.caches, layers)]
            for name in ("step_host_plan", "step_device_plan"):
                ratios = interleaved_ratios(steps[name], steps[f"{name}_unguarded"], call_args,
                                            self.args, pairs=GUARD_RATIO_PAIRS)
                record[f"{name}_guard_ratio"] = median(ratios)
                record[f"{name}_guard_ratio_quartiles"] = quartiles(ratios)
        self.time_guard(run)

    def time_guard(self, run: PointRun, copies: int = 64) -> None:
        """The guard alone, once per step: ``guard_us`` without a Plan (the lengths only, as with
        ``plan="device"`` or None) and ``guard_plan_us`` with one (the plan's works rewritten too,
        as in both steps of ``time_model_step``), each the time of ``copies`` independent guards in
        one jitted program over ``copies``."""
        import jax
        import jax.numpy as jnp
        import jax_mla

        layout, record = run.layout, run.record
        pt = layout.point
        tables = [jnp.array(run.tables) for _ in range(copies)]
        lens = [jnp.array(run.lens) for _ in range(copies)]
        plan = jax_mla.plan(np.asarray(layout.lengths, np.int32), num_heads=pt.H, q_len=pt.q_len,
                            max_pages=layout.max_pages)
        fn = m.guards_only(copies, run.caches[0].shape[0], pt.page_size, pt.q_len)
        for name, planned in (("guard_us", None), ("guard_plan_us", plan)):
            jax.block_until_ready(fn(tables, lens, planned))
            seconds, _ = time_jax(lambda *a: fn(*a), [(tables, lens, planned)], copies, self.args)
            record[name] = seconds * 1e6

    def time_layers(self, run: PointRun, method: str, fn, plan, layers: int) -> np.ndarray:
        """Check ``fn``'s first layer against the reference, then time it per layer (unless the
        check failed); returns that layer's output for the checked requests, float32."""
        import jax

        record = run.record
        w = work(run.layout, model=self.args.floor_model)
        call_args = [(run.q, s, run.tables, run.lens, plan) for s in m.rotation_sets(run.caches, layers)]
        t0 = time.perf_counter()
        first = fn(*call_args[0])
        jax.block_until_ready(first)
        record[f"{method}_first_call_s"] = time.perf_counter() - t0  # compile + one call
        first_rows = np.asarray(first[0][:run.checked].astype(np.float32))
        ok = run.check(method, first_rows)
        if method == "jax_mla":
            run.outputs["jax_mla"] = first[0]
        del first
        if not ok:
            return first_rows
        per_layer_s, rounds = time_jax(fn, call_args, layers, self.args)
        us = per_layer_s * 1e6
        record[f"{method}_us"] = us
        record[f"{method}_rounds"] = rounds
        record[f"{method}_layers"] = layers
        record["methods_done"].append(method)
        if method in m.GPU_BUSY_METHODS and _on_gpu(run.q):
            self.record_gpu_busy(run, method, fn, call_args, layers, per_layer_s)
        if method in self.slowdown and w["floor_us"] >= 50:
            self.slowdown[method] = max(2.0, us / w["floor_us"])
        if method == "jax_mla":
            record["jax_mla_tflops"] = w["flops"] / per_layer_s / 1e12
            record["jax_mla_tbps"] = w["bytes"] / per_layer_s / 1e12
            record["jax_mla_frac_floor"] = w["floor_us"] / us
        return first_rows

    def record_gpu_busy(self, run: PointRun, method: str, fn, call_args: list[tuple], layers: int,
                        per_layer_s: float) -> None:
        """``<method>_gpu_us``: the GPU's busy time per layer over about one timing round of calls
        (``gpu_busy_per_layer_us``; at least 4 calls), or why not in ``<method>_gpu_us_skip``."""
        calls = max(4, min(200, math.ceil(self.args.round_s / (per_layer_s * layers))))
        us, why = gpu_busy_per_layer_us(fn, call_args, layers, calls)
        if us is None:
            run.record[f"{method}_gpu_us_skip"] = why
        else:
            run.record[f"{method}_gpu_us"] = us


def _on_gpu(array) -> bool:
    from jax_mla import backends

    return backends.platform_of(array) in ("gpu", "cuda")


def _naive_layer(query, cache, tables, lens, plan_):
    return m.xla_naive_decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE)


def _xla_backend_layer(query, cache, tables, lens, plan_):
    import jax_mla

    return jax_mla.decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE, backend="xla")


@functools.cache
def _quantize_pages():
    import jax
    from jax_mla import fp8_cache

    def quantize(pages):
        rows = pages.reshape(-1, HEAD_DIM)
        return fp8_cache.quantize_rows(rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:]).reshape(
            pages.shape[0], pages.shape[1], FP8_ROW_BYTES)

    return jax.jit(quantize)


def quantized_cache(cache, pages_per_chunk: int = 4096):
    """The fp8 cache (uint8 [num_pages, page_size, FP8_ROW_BYTES]) of a bf16 cache, quantised as
    ``jax_mla.write_kv`` does, a chunk of pages at a time (bounded temporaries)."""
    import jax.numpy as jnp

    chunks = [_quantize_pages()(cache[start:start + pages_per_chunk])
              for start in range(0, cache.shape[0], pages_per_chunk)]
    return jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def _sm90_backend_layer(query, cache, tables, lens, plan_):
    import jax_mla

    return jax_mla.decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE, backend="sm90")
