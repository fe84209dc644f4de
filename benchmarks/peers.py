"""The FlashInfer peer: the same kernels called from torch through
``flashinfer.mla.BatchMLAPagedAttentionWrapper``, on the same caches (shared through DLPack),
how it is timed, and the bit-for-bit comparison with jax_mla."""

from __future__ import annotations

import dataclasses
import inspect
import math
import traceback
import warnings

import numpy as np

from benchmarks.problem import KV_LORA_RANK, ROPE_DIM, SOFTMAX_SCALE, Layout, fp8_errors, work
from benchmarks.timing import host_time_us, time_torch
from jax_mla.fp8_cache import E4M3_MAX
# FlashInfer's fp8 MLA cache, scaled two ways (see flashinfer_fp8_views).
FP8_SCALE_LAYOUTS = ("group", "tensor")
# An fp8 output farther than this from the bf16 cache's reference is broken, not imprecise.
FP8_VS_BF16_TOL = 0.15


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

    def plan(self, layout: Layout, device_meta: dict, kv_data_type=None):
        """Plans for the bf16 cache, or for the cache type ``kv_data_type`` (a torch dtype)."""
        torch = self.torch
        pt = layout.point
        kwargs = dict(num_heads=pt.H, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM,
                      page_size=pt.page_size, causal=pt.q_len > 1, sm_scale=SOFTMAX_SCALE,
                      q_data_type=torch.bfloat16, kv_data_type=kv_data_type or torch.bfloat16)
        csr = {k: device_meta[k] for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")}
        if self.canonical:
            kwargs["metadata"] = self.fmla.MLAPlanMetadata.csr(*csr.values())
            for name, value in (("query_layout", "split"), ("kv_cache_layout", "split")):
                if name in self.plan_params:
                    kwargs[name] = value
        else:
            kwargs.update(csr)
        kwargs = {k: v for k, v in kwargs.items() if k in self.plan_params}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.wrapper.plan(**kwargs)

    def run(self, q_nope, q_pe, ckv, kpe, out=None, **scales):
        """One decode; ``scales``: an fp8 cache's ``ckv_scale`` or ``ckv_scale_arr``, and
        ``kpe_scale`` (flashinfer_fp8_views)."""
        extra = {"out": out} if (out is not None and self.run_has_out) else {}
        extra.update(scales)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            if self.canonical:
                return self.wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), **extra)
            return self.wrapper.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, **extra)


def _to_e4m3(torch, x, scale: float, pages_per_chunk: int):
    """``x / scale`` (in float32) of a [P, S, C] tensor as float8_e4m3fn, clipped to e4m3's finite
    range, a chunk of pages at a time."""
    return torch.cat([(x[i:i + pages_per_chunk].float() / scale).clamp_(-E4M3_MAX, E4M3_MAX)
                      .to(torch.float8_e4m3fn) for i in range(0, x.shape[0], pages_per_chunk)])


def _per_tensor_scale(torch, x, pages_per_chunk: int) -> float:
    """max |x| / 448 over a [P, S, C] tensor, a chunk of pages at a time (1 when x is all zero)."""
    amax = max(float(x[i:i + pages_per_chunk].float().abs().amax())
               for i in range(0, x.shape[0], pages_per_chunk))
    return amax / E4M3_MAX if amax > 0 else 1.0


def flashinfer_fp8_views(torch, bf16_cache, fp8_cache, scales: str,
                         pages_per_chunk: int = 4096) -> tuple:
    """FlashInfer's fp8 MLA cache made from one of a point's caches: (ckv, kpe, run kwargs).

    ``bf16_cache``: torch bfloat16 [P, S, 576]; ``fp8_cache``: torch uint8 [P, S, 656], the same
    cache quantised as ``jax_mla.write_kv`` does (docs/fp8-cache.md). ckv: float8_e4m3fn
    [P, S, 512]; kpe: float8_e4m3fn [P, S, 64], the rope over one ``kpe_scale`` (FlashInfer takes
    the rope in e4m3). ``scales="group"``: ckv and ``ckv_scale_arr`` (float32 [P, S, 4]) are
    jax_mla's latent bytes and scales, byte for byte; ``"tensor"``: ckv is the bf16 latent over one
    ``ckv_scale`` = max |latent| / 448, as issue 15's table timed FlashInfer."""
    if scales not in FP8_SCALE_LAYOUTS:
        raise ValueError(f"scales must be one of {FP8_SCALE_LAYOUTS}, got {scales!r}")
    latent, rope = bf16_cache[..., :KV_LORA_RANK], bf16_cache[..., KV_LORA_RANK:]
    kpe_scale = _per_tensor_scale(torch, rope, pages_per_chunk)
    kpe = _to_e4m3(torch, rope, kpe_scale, pages_per_chunk)
    if scales == "group":
        groups = KV_LORA_RANK // 128
        ckv = fp8_cache[..., :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn)
        scale_bytes = fp8_cache[..., KV_LORA_RANK:KV_LORA_RANK + 4 * groups].contiguous()
        return ckv, kpe, {"ckv_scale_arr": scale_bytes.view(torch.float32),
                          "kpe_scale": kpe_scale}
    ckv_scale = _per_tensor_scale(torch, latent, pages_per_chunk)
    ckv = _to_e4m3(torch, latent, ckv_scale, pages_per_chunk)
    return ckv, kpe, {"ckv_scale": ckv_scale, "kpe_scale": kpe_scale}


def dequantize_flashinfer_fp8(torch, ckv, kpe, scales: dict):
    """float32 [..., 576] of FlashInfer's fp8 MLA cache as its API defines it: the e4m3 latent
    ``ckv`` [..., 512] times ``ckv_scale`` (or ``ckv_scale_arr`` [..., 4], per token and 128
    channels), then the e4m3 rope ``kpe`` [..., 64] times ``kpe_scale``."""
    latent = ckv.float()
    if "ckv_scale_arr" in scales:
        groups = scales["ckv_scale_arr"]
        latent = (latent.unflatten(-1, (groups.shape[-1], -1)) * groups[..., None]).flatten(-2)
    else:
        latent = latent * scales["ckv_scale"]
    return torch.cat([latent, kpe.float() * scales["kpe_scale"]], dim=-1)


@dataclasses.dataclass
class TorchInputs:
    """One point's query, caches and outputs as torch tensors, and FlashInfer's CSR metadata."""

    meta: dict
    q_nope: object
    q_pe: object
    views: list  # (ckv, kpe) per cache copy
    outs: list  # one output per layer
    layers: int
    scales: list = dataclasses.field(default_factory=list)  # an fp8 copy's run kwargs, per copy

    def scales_of(self, copy: int) -> dict:
        return self.scales[copy] if self.scales else {}

    @classmethod
    def build(cls, torch, layout: Layout, q, caches, layers: int, dev: str = "cuda") -> "TorchInputs":
        pt = layout.point
        meta = {
            "qo_indptr": torch.arange(pt.B + 1, dtype=torch.int32, device=dev) * pt.q_len,
            "kv_indptr": torch.from_numpy(layout.kv_indptr).to(dev),
            "kv_indices": torch.from_numpy(layout.kv_indices).to(dev),
            "kv_len_arr": torch.from_numpy(layout.lengths.astype(np.int32)).to(dev),
        }
        q_t = torch.from_dlpack(q)
        q_nope = q_t[..., :KV_LORA_RANK].reshape(pt.B * pt.q_len, pt.H, KV_LORA_RANK).contiguous()
        q_pe = q_t[..., KV_LORA_RANK:].reshape(pt.B * pt.q_len, pt.H, ROPE_DIM).contiguous()
        views = []
        for c in caches:
            t = torch.from_dlpack(c)
            views.append((t[..., :KV_LORA_RANK], t[..., KV_LORA_RANK:]))
        outs = [torch.empty(pt.B * pt.q_len, pt.H, KV_LORA_RANK, dtype=torch.bfloat16, device=dev)
                for _ in range(layers)]
        return cls(meta, q_nope, q_pe, views, outs, layers)

    def eager_step(self, peer: FlashInferPeer):
        """A function running ``layers`` calls, each on the next cache copy (rotating over calls)."""
        n = len(self.views)
        n_sets = n // math.gcd(self.layers, n)
        counter = [0]

        def step():
            base = (counter[0] % n_sets) * self.layers
            counter[0] += 1
            for i in range(self.layers):
                copy = (base + i) % n
                peer.run(self.q_nope, self.q_pe, *self.views[copy], out=self.outs[i],
                         **self.scales_of(copy))

        return step

    def graph_seconds_per_layer(self, torch, peer: FlashInferPeer, args) -> float:
        """The same runs replayed from one CUDA graph (no Python per call)."""
        n, layers = len(self.views), self.layers
        # Each replay reads every copy once, in the same cyclic order as the eager runs (a replay
        # that stopped part-way through the cycle would re-read a copy still in L2).
        total = n * math.ceil(layers / n)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for j in range(min(total, 2 * layers)):
                peer.run(self.q_nope, self.q_pe, *self.views[j % n], out=self.outs[j % layers],
                         **self.scales_of(j % n))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(total):
                peer.run(self.q_nope, self.q_pe, *self.views[j % n], out=self.outs[j % layers],
                         **self.scales_of(j % n))
        torch.cuda.synchronize()
        per_layer_s, _ = time_torch(graph.replay, total, args, torch)
        del graph
        return per_layer_s


class FlashInferTimer:
    """Times FlashInfer from torch on a point's caches: each of --fi-backends eagerly and from a
    CUDA graph; the faster backend's numbers also go under ``flashinfer_torch_*``. Keeps one
    wrapper per backend (and why one could not be made) across points."""

    def __init__(self, torch, args, progress, device: str = "cuda"):
        self.torch = torch
        self.args = args
        self.progress = progress
        self.device = device
        self.peers: dict[str, FlashInferPeer] = {}
        self.errors: dict[str, str] = {}

    def peer(self, backend: str) -> FlashInferPeer:
        if backend not in self.peers and backend not in self.errors:
            try:
                self.peers[backend] = FlashInferPeer(self.torch, backend)
            except Exception as e:  # noqa: BLE001
                self.errors[backend] = f"{type(e).__name__}: {e}"
        if backend in self.errors:
            raise RuntimeError(self.errors[backend])
        return self.peers[backend]

    def run(self, run) -> None:
        """``run``: the point (benchmarks.bench.PointRun)."""
        import jax

        torch = self.torch
        jax.block_until_ready((run.q, run.caches))
        inputs = TorchInputs.build(torch, run.layout, run.q, run.caches, self.args.layers, self.device)
        try:
            for backend in self.args.fi_backends:
                try:
                    self.time_backend(run, backend, inputs)
                except Exception as e:  # noqa: BLE001
                    run.record["errors"][f"flashinfer_{backend}"] = f"{type(e).__name__}: {e}"
                    if self.args.verbose:
                        traceback.print_exc()
            self.pick_fastest(run)
        finally:
            torch.cuda.synchronize()  # the views, outputs and metadata die with this frame

    def run_fp8(self, run, fp8_caches: list) -> None:
        """FlashInfer on its fp8 cache, made from each of the point's caches in both scale layouts
        (flashinfer_fp8_views), for each of --fi-backends: the output against the bf16 cache's
        float32 reference (``<name>_vs_bf16_err``, ``<name>_vs_bf16_l2``), then its time per layer
        (``<name>_graph_us`` replayed from a CUDA graph with --fi-graph, else ``<name>_us``), where
        ``<name>`` is ``flashinfer_<backend>_fp8_<layout>``. ``fp8_caches``: the point's caches
        quantised as ``write_kv`` does (uint8 JAX arrays), one per bf16 cache."""
        import jax

        torch = self.torch
        jax.block_until_ready((run.q, run.caches, fp8_caches))
        base = TorchInputs.build(torch, run.layout, run.q, run.caches, self.args.layers, self.device)
        try:
            for layout in FP8_SCALE_LAYOUTS:
                built = [flashinfer_fp8_views(torch, torch.from_dlpack(c), torch.from_dlpack(f),
                                              layout) for c, f in zip(run.caches, fp8_caches)]
                inputs = dataclasses.replace(base, views=[b[:2] for b in built],
                                             scales=[b[2] for b in built])
                del built
                for backend in self.args.fi_backends:
                    name = f"flashinfer_{backend}_fp8_{layout}"
                    try:
                        self.time_fp8(run, backend, name, inputs)
                    except Exception as e:  # noqa: BLE001
                        run.record["errors"][name] = f"{type(e).__name__}: {e}"
                        if self.args.verbose:
                            traceback.print_exc()
                del inputs
                torch.cuda.synchronize()
            run.record["methods_done"].append("flashinfer_fp8")
        finally:
            torch.cuda.synchronize()

    def time_fp8(self, run, backend: str, name: str, inputs: TorchInputs) -> None:
        torch, args, record = self.torch, self.args, run.record
        pt = run.layout.point
        self.progress.status(f"{name}: plan (JIT build on first use)")
        peer = self.peer(backend)
        peer.plan(run.layout, inputs.meta, kv_data_type=torch.float8_e4m3fn)
        out0 = peer.run(inputs.q_nope, inputs.q_pe, *inputs.views[0], out=inputs.outs[0],
                        **inputs.scales_of(0)).view(pt.B, pt.q_len, pt.H, KV_LORA_RANK)
        torch.cuda.synchronize()
        if run.ref is None:
            record["errors"][name] = "no reference output to check against; not timed"
            return
        err, l2 = fp8_errors(out0[:run.checked].float().cpu().numpy(), run.ref)
        record[f"{name}_vs_bf16_err"], record[f"{name}_vs_bf16_l2"] = err, l2
        if not err <= FP8_VS_BF16_TOL:
            record["errors"][name] = (f"output check failed: rel err {err:.3g} > {FP8_VS_BF16_TOL} "
                                      f"against the bf16 cache's float32 reference; not timed")
            return
        self.progress.status(f"{name}: timing")
        if args.fi_graph:
            record[f"{name}_graph_us"] = inputs.graph_seconds_per_layer(torch, peer, args) * 1e6
        else:
            per_layer_s, _ = time_torch(inputs.eager_step(peer), inputs.layers, args, torch)
            record[f"{name}_us"] = per_layer_s * 1e6

    def time_backend(self, run, backend: str, inputs: TorchInputs) -> None:
        torch, args, record = self.torch, self.args, run.record
        pt = run.layout.point
        name = f"flashinfer_{backend}"
        self.progress.status(f"{name}: plan (JIT build on first use)")
        peer = self.peer(backend)

        def replan():
            peer.plan(run.layout, inputs.meta)
            torch.cuda.synchronize()

        replan()
        record[f"{name}_plan_us"] = host_time_us(replan, args.plan_repeats)
        out0 = peer.run(inputs.q_nope, inputs.q_pe, *inputs.views[0], out=inputs.outs[0]).view(
            pt.B, pt.q_len, pt.H, KV_LORA_RANK)
        torch.cuda.synchronize()
        ok = run.check(name, out0[:run.checked].float().cpu().numpy())
        run.outputs[name] = out0.clone()
        if not ok:
            return
        self.progress.status(f"{name}: timing")
        per_layer_s, how = time_torch(inputs.eager_step(peer), inputs.layers, args, torch)
        record[f"{name}_us"] = per_layer_s * 1e6
        record["flashinfer_timer"] = how
        if args.fi_graph:
            self.progress.status(f"{name}: CUDA graph")
            try:
                record[f"{name}_graph_us"] = inputs.graph_seconds_per_layer(torch, peer, args) * 1e6
            except Exception as e:  # noqa: BLE001
                record["errors"][f"{name}_graph"] = f"{type(e).__name__}: {e}"

    def pick_fastest(self, run) -> None:
        """The faster FlashInfer backend's numbers under the ``flashinfer_*`` names."""
        record = run.record
        timed = [b for b in self.args.fi_backends if record.get(f"flashinfer_{b}_us") is not None]
        if not timed:
            return
        best = min(timed, key=lambda b: record[f"flashinfer_{b}_us"])
        w = work(run.layout, model=self.args.floor_model)
        us = record[f"flashinfer_{best}_us"]
        record["flashinfer_torch_us"] = us
        record["flashinfer_torch_backend"] = best
        record["flashinfer_plan_us"] = record.get(f"flashinfer_{best}_plan_us")
        record["flashinfer_tflops"] = w["flops"] / (us * 1e-6) / 1e12
        record["flashinfer_tbps"] = w["bytes"] / (us * 1e-6) / 1e12
        graphs = [record[f"flashinfer_{b}_graph_us"] for b in self.args.fi_backends
                  if record.get(f"flashinfer_{b}_graph_us") is not None]
        if graphs:
            record["flashinfer_graph_us"] = min(graphs)
        record["methods_done"].append("flashinfer")


def compare_bitwise(torch, record: dict, outputs: dict) -> None:
    """jax_mla against FlashInfer-torch on the same cache, same backend when both ran."""
    if "jax_mla" not in outputs:
        return
    chosen = record.get("jax_mla_backend")
    name = f"flashinfer_{chosen}" if f"flashinfer_{chosen}" in outputs else next(
        (k for k in outputs if k.startswith("flashinfer_")), None)
    if name is None:
        return
    import jax

    theirs = outputs[name]
    mine = torch.from_dlpack(jax.block_until_ready(outputs["jax_mla"])).to(theirs.device)
    record["jax_mla_vs_flashinfer_peer"] = name
    record["jax_mla_vs_flashinfer_max_abs_diff"] = float(
        (mine.float() - theirs.float()).abs().max().item())
    record["jax_mla_vs_flashinfer_bitwise"] = bool(torch.equal(mine, theirs))
