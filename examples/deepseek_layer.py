"""DeepSeek's MLA attention decoding through jax_mla, each step checked against plain attention.

    python examples/deepseek_layer.py                       # embedded tiny config, seconds on a CPU
    python examples/deepseek_layer.py --config v2-lite --layers 4 --steps 32
    python examples/deepseek_layer.py --kv-dtype fp8        # the fp8 (e4m3) latent cache
    python examples/deepseek_layer.py --config path/to/DeepSeek-V3/config.json --batch 8 \\
        --prompt-len 1024                                   # V3's shapes want a GPU

A stack of MLA attention layers with random (seeded) weights prefills requests of different prompt
lengths, whose pages come from one shuffled pool, then decodes them greedily: each step runs the
weight-absorbed attention through ``jax_mla.decode`` in one jitted function that updates the paged
caches in place. It prints the decode throughput over the steps after the first (which compiles),
then the check: every layer's output at every step recomputed without absorption over a dense copy
of its history. The run exits 1 when they differ by more than the tolerance (bf16's, or the fp8
cache's). Needs no torch and downloads nothing.

With ``--kv-dtype fp8`` the paged caches are jax_mla's fp8 cache (docs/fp8-cache.md): ``write_kv``
quantises every latent row to e4m3 with one power-of-two scale per 128 channels (the rope part
stays bf16), and ``--backend auto`` runs it on a backend that takes it: xla, or on Hopper jax_mla's
sm90 kernel where the pages hold 32 or 64 tokens. The check's reference keeps the unquantised bf16
latents, so its error includes the quantisation's, held to its own tolerance.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time


class _PreParser(argparse.ArgumentParser):
    """Reads one option before the full parser runs; what it cannot read, the full parser reports."""

    def error(self, message):
        raise ValueError(message)


def _host_devices_for_tp(argv: list[str]) -> None:
    """On a CPU, --tp N needs N host devices, which XLA only creates if told before jax loads.
    --tp is read as the full parser reads it (any spelling argparse takes, such as --tp=+2)."""
    pre = _PreParser(add_help=False)
    pre.add_argument("--tp", type=int, default=1)
    try:
        count = pre.parse_known_args(argv)[0].tp
    except ValueError:
        return
    if count > 1 and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={count}").strip()


_host_devices_for_tp(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepseek_mla as model  # noqa: E402

import jax_mla  # noqa: E402
from jax_mla import backends, fp8_cache  # noqa: E402

# Max |absorbed - reference| over max |reference|, per layer and step: bf16 tolerance.
TOLERANCE = 2e-2
# The same with --kv-dtype fp8 against the reference on the unquantised latents, so it includes the
# e4m3 quantisation's error (docs/fp8-cache.md, "In the example", says how it was set).
FP8_TOLERANCE = 1.2e-1
KV_DTYPES = ("bf16", fp8_cache.FP8)
TOLERANCES = {"bf16": TOLERANCE, fp8_cache.FP8: FP8_TOLERANCE}
DEFAULT_CONFIG = "tiny"
# The backends whose kernels read a work schedule built once per step (jax_mla.plan).
PLANNED_BACKENDS = (backends.FA3, backends.FA2)


def _format_tolerance(tolerance: float) -> str:
    """2e-02, 1.2e-01: one significant digit where that is exact, two otherwise."""
    return f"{tolerance:.1e}".replace(".0e", "e")


def _shapes(cfg: model.MLAConfig) -> str:
    q_path = f"q_lora_rank {cfg.q_lora_rank}" if cfg.q_lora_rank else "plain wq"
    return f"dim {cfg.dim}, {cfg.n_heads} heads, {q_path}, kv_lora_rank {cfg.kv_lora_rank}"


CONFIG_HELP = (
    f"the attention's shapes: {DEFAULT_CONFIG!r} (embedded default: "
    f"{_shapes(model.CONFIGS[DEFAULT_CONFIG])}; seconds on a CPU), "
    f"'v2-lite' (DeepSeek-V2-Lite: {_shapes(model.CONFIGS['v2-lite'])}), "
    f"'v3' (DeepSeek-V3/R1: {_shapes(model.CONFIGS['v3'])}; wants a GPU), "
    "or the path of a DeepSeek-V2/V3 HuggingFace config.json, e.g. DeepSeek-V3's, of which the "
    "attention hyper-parameters and YaRN scaling are read. Weights are random whatever the config.")


def bounded_int(low: int):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive_int = bounded_int(1)


def mla_config(text: str) -> model.MLAConfig:
    """An argparse type: a config name of ``model.CONFIGS`` or the path of a config.json."""
    if text in model.CONFIGS:
        return model.CONFIGS[text]
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(model.CONFIGS)} or the path of "
                                         f"a config.json, got {text!r}")
    try:
        return model.config_from_hf(text)
    except (ValueError, OSError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


mla_config.__name__ = "config"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, and the module docstring as written."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", type=mla_config, default=DEFAULT_CONFIG, metavar="NAME|CONFIG.JSON",
                        help=CONFIG_HELP)
    parser.add_argument("--batch", type=positive_int, default=4, help="requests decoded together")
    parser.add_argument("--prompt-len", type=positive_int, default=48,
                        help="longest prompt; the others are shorter, at random")
    parser.add_argument("--steps", type=positive_int, default=16,
                        help="decode steps; the first compiles, the others are timed")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per cache page")
    parser.add_argument("--backend", default="auto", choices=["auto", *backends.ALL_BACKENDS],
                        help="jax_mla backend; auto: the best one available here (xla on a CPU)")
    parser.add_argument("--layers", type=positive_int, default=2, help="stacked attention layers")
    parser.add_argument("--seed", type=bounded_int(0), default=0, help="weights, prompts and pages")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor parallelism: split the attention heads over this many devices")
    parser.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES,
                        help="the paged latent cache: bf16, or fp8 (e4m3 latent with a float32 scale "
                             "per 128 channels and a bf16 rope part, 656 instead of 1152 bytes a token "
                             "for kv_lora_rank 512; docs/fp8-cache.md), which write_kv quantises and "
                             "backend auto decodes on xla, or on Hopper on sm90 where it takes the "
                             "shapes. The check's reference uses the unquantised "
                             f"latents; its tolerance is {_format_tolerance(TOLERANCE)} for bf16 "
                             f"and {_format_tolerance(FP8_TOLERANCE)} for fp8")
    args = parser.parse_args(argv)

    cfg = args.config
    if args.prompt_len + args.steps > cfg.max_seq_len:
        parser.error(f"--prompt-len + --steps = {args.prompt_len + args.steps} exceeds the "
                     f"{cfg.name} config's max_seq_len {cfg.max_seq_len}")
    if cfg.n_heads % args.tp:
        parser.error(f"--tp {args.tp} must divide the {cfg.name} config's {cfg.n_heads} heads")
    if args.tp > jax.device_count():
        parser.error(f"--tp {args.tp} needs {args.tp} devices, this machine has {jax.device_count()}")
    if args.backend != "auto" and args.backend not in (available := jax_mla.available_backends()):
        parser.error(f"--backend {args.backend} cannot run here ({jax.default_backend()}); "
                     f"available: {available}")
    if args.kv_dtype == fp8_cache.FP8:
        try:
            fp8_cache.layout(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
            concrete_backend(args.backend, args.kv_dtype)
        except (TypeError, ValueError) as error:
            parser.error(f"--kv-dtype fp8: {error}")
    return args


class Progress:
    """A loop's progress on stderr: on a terminal one line redrawn in place; elsewhere (a log, a
    pipe) a plain line at each quarter of the loop."""

    def __init__(self, total: int, label: str, stream=None, width: int = 24):
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.milestones = {math.ceil(total * quarter / 4) for quarter in (1, 2, 3, 4)}

    def update(self, done: int, note: str = "") -> None:
        if self.interactive:
            filled = self.width * done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            sys.stdout.flush()  # keep stdout lines ahead of the bar when both go to one terminal
            self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {note}")
        elif done in self.milestones:
            self.stream.write(f"{self.label} {done}/{self.total} {note}".rstrip() + "\n")
        else:
            return
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


def prompt_lengths(rng: np.random.Generator, batch: int, longest: int) -> np.ndarray:
    """int32 [batch] in [1, longest]; the first request gets the longest prompt."""
    lengths = rng.integers(1, longest + 1, size=batch)
    lengths[0] = longest
    return lengths.astype(np.int32)


def assign_pages(rng: np.random.Generator, total_lens: np.ndarray, page_size: int):
    """Give every request the pages its whole run needs, from one shuffled pool.

    Returns (block_tables int32 [B, max_pages], padded with page 0 past a request's pages;
    num_pages of the pool).
    """
    pages_needed = -(-total_lens // page_size)
    num_pages = int(pages_needed.sum())
    order = rng.permutation(num_pages)
    tables = np.zeros((len(total_lens), int(pages_needed.max())), np.int32)
    start = 0
    for b, count in enumerate(pages_needed):
        tables[b, :count] = order[start:start + count]
        start += count
    return tables, num_pages


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected| in float64; inf when ``actual`` is not finite."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not np.isfinite(actual).all():
        return float("inf")
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def cache_format(kv_dtype: str) -> str:
    """The ``jax_mla.backends`` cache format of a ``--kv-dtype``."""
    return backends.FP8_CACHE if kv_dtype == fp8_cache.FP8 else backends.FLOAT_CACHE


def concrete_backend(requested: str, kv_dtype: str = "bf16", shard=None, *,
                     kv_lora_rank: int = 512) -> str:
    """The backend ``jax_mla.decode(backend=requested)`` runs for this example's bf16 queries on a
    cache of ``kv_dtype``: given one device's ``shard`` (shapes of its query, cache and block
    table), what ``jax_mla.backend_for`` names for it without a plan (fa3 and fa2 then get one from
    ``step_plan``, which keeps them); without, what ``requested`` resolves to. TypeError when
    ``requested`` does not take that cache."""
    if shard is None:
        return backends.resolve(requested, jax.default_backend(), jnp.bfloat16,
                                cache_format(kv_dtype))
    return jax_mla.backend_for(*shard, backend=requested, kv_lora_rank=kv_lora_rank)


def shard_shapes(cfg: model.MLAConfig, args: argparse.Namespace, num_pages: int, max_pages: int):
    """Shape-dtype structs of one device's decode arguments: query [B, 1, heads / tp, head dim],
    cache [num_pages, page_size, row] and block table [B, max_pages]."""
    head_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if args.kv_dtype == fp8_cache.FP8:
        row = fp8_cache.layout(cfg.kv_lora_rank, cfg.qk_rope_head_dim).row_bytes
        cache = jax.ShapeDtypeStruct((num_pages, args.page_size, row), fp8_cache.STORAGE_DTYPE)
    else:
        cache = jax.ShapeDtypeStruct((num_pages, args.page_size, head_dim), jnp.bfloat16)
    return (jax.ShapeDtypeStruct((args.batch, 1, cfg.n_heads // args.tp, head_dim), jnp.bfloat16),
            cache, jax.ShapeDtypeStruct((args.batch, max_pages), jnp.int32))


def describe(cfg: model.MLAConfig, args: argparse.Namespace, backend: str) -> str:
    line = (f"config {cfg.name}: {_shapes(cfg)}, qk_nope {cfg.qk_nope_head_dim}, "
            f"qk_rope {cfg.qk_rope_head_dim}, v_head {cfg.v_head_dim}; softmax_scale "
            f"{cfg.softmax_scale:.5f} (YaRN mscale {cfg.yarn_mscale:.4f})\n"
            f"backend {backend} ({args.backend}) on {jax.default_backend()}, tp {args.tp}, "
            f"{args.layers} layer(s), bf16")
    if args.kv_dtype == fp8_cache.FP8:
        row = fp8_cache.layout(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        takers = [b.name for b in backends.TABLE if backends.FP8_CACHE in b.cache_formats]
        line += (f", fp8 cache ({row.row_bytes} B/token vs bf16's {2 * row.head_dim}; "
                 f"{'auto runs it on ' + backend if args.backend == 'auto' else 'backend ' + backend}"
                 f"; backends that take it: {', '.join(takers)})")
    return line


def make_requests(rng: np.random.Generator, cfg: model.MLAConfig, args: argparse.Namespace):
    """Random prompts and their pages: (prompt lengths int32 [B], padded prompt tokens int32 [B, P],
    block_tables int32 [B, max_pages], num_pages)."""
    lens = prompt_lengths(rng, args.batch, args.prompt_len)
    tables, num_pages = assign_pages(rng, lens + args.steps, args.page_size)
    tokens = rng.integers(0, cfg.vocab_size, size=(args.batch, args.prompt_len)).astype(np.int32)
    tokens[np.arange(args.prompt_len)[None, :] >= lens[:, None]] = 0  # padding
    return lens, tokens, tables, num_pages


def placement(tp: int):
    """(the sharding every array of the steps is committed to, the query's head sharding or None).

    A jitted function's outputs are committed to their devices as soon as one input is (a
    ``jax_mla.plan`` workspace is), and a committed argument compiles apart from an uncommitted one
    of the same shape. So everything the steps take is put here before the first step: the steps
    then see the same placement at every call and compile once.
    """
    if tp == 1:
        return SingleDeviceSharding(jax.devices()[0]), None
    # Weights, caches and tables replicated; the attention heads split over the "tp" axis.
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(None, None, "tp", None))


def step_plan(backend: str, cfg: model.MLAConfig, seq_lens: np.ndarray, *, max_pages: int, tp: int,
              place):
    """The fa3/fa2 work schedule for one step's lengths, built on the host and shared by every
    layer (None for the other backends, which need none). Under tensor parallelism it is built for
    the per-device head count and replicated like the other arrays."""
    if backend not in PLANNED_BACKENDS:
        return None
    plan = jax_mla.plan(seq_lens, num_heads=cfg.n_heads // tp, max_pages=max_pages,
                        kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim)
    return jax.device_put(plan, place)


def decode(decode_step, make_plan, params, caches, block_tables, first_tokens, prompt_lens: np.ndarray,
           steps: int, place):
    """Run ``steps`` greedy decode steps, reading each step's tokens back as a generator would.

    ``make_plan(seq_lens)`` gives the step's ``jax_mla.Plan`` (or None) from host lengths.

    Returns (seconds of each step, tokens int32 [B, steps + 1] starting with ``first_tokens``, and
    per step (positions, attention inputs, attention outputs) for the check).
    """
    step_times, generated, record = [], [np.asarray(first_tokens)], []
    tokens = first_tokens
    progress = Progress(steps, "decode")
    for step in range(steps):
        host_positions = prompt_lens + np.int32(step)
        start = time.perf_counter()
        positions = jax.device_put(host_positions, place)
        plan = make_plan(host_positions + 1)
        caches, tokens, attn_inputs, attn_outputs = decode_step(params, caches, block_tables, tokens,
                                                                positions, plan)
        generated.append(np.asarray(tokens))
        step_times.append(time.perf_counter() - start)
        record.append((positions, attn_inputs, attn_outputs))
        progress.update(step + 1)
    progress.close()
    return step_times, np.stack(generated, axis=1), record


def check(reference_step, params, histories, record) -> list[float]:
    """Recompute every step's attention without absorption; the max relative error of each step."""
    errors = []
    progress = Progress(len(record), "check")
    for positions, attn_inputs, attn_outputs in record:
        histories, expected = reference_step(params, histories, attn_inputs, positions)
        errors.append(max(relative_error(got, want)
                          for got, want in zip(np.asarray(attn_outputs), np.asarray(expected))))
        progress.update(len(errors), f"max rel err {max(errors):.2e}")
    progress.close()
    return errors


def run(args: argparse.Namespace) -> dict:
    """Prefill, decode and check. Returns max_error and its tolerance, the backend run,
    first_step_s (compile included), ms_per_step and tokens_per_s over the later steps (NaN for a
    single step), check_s and the generated tokens [B, steps + 1]."""
    cfg = args.config
    rng = np.random.default_rng(args.seed)
    lens, tokens, tables, num_pages = make_requests(rng, cfg, args)
    backend = concrete_backend(args.backend, args.kv_dtype,
                               shard_shapes(cfg, args, num_pages, tables.shape[1]),
                               kv_lora_rank=cfg.kv_lora_rank)
    tolerance = TOLERANCES[args.kv_dtype]
    print(describe(cfg, args, backend))
    print(f"{args.batch} requests, prompt lengths {lens.tolist()}, {args.steps} decode steps; "
          f"{num_pages} pages of {args.page_size} tokens per layer, shuffled")

    place, head_sharding = placement(args.tp)
    params = jax.device_put(model.init_model(args.seed, cfg, args.layers), place)
    # bf16, or the fp8 cache (uint8 rows: e4m3 latent, scales, bf16 rope) that write_kv quantises.
    cache_dtype = fp8_cache.FP8 if args.kv_dtype == fp8_cache.FP8 else jnp.bfloat16
    caches = jax.device_put([jax_mla.allocate_cache(num_pages, args.page_size,
                                                    kv_lora_rank=cfg.kv_lora_rank,
                                                    rope_dim=cfg.qk_rope_head_dim, dtype=cache_dtype)
                             for _ in range(args.layers)], place)
    block_tables = jax.device_put(tables, place)
    # Donated caches (and histories) are updated in place instead of copied every step.
    prefill = jax.jit(functools.partial(model.prefill, cfg=cfg), donate_argnums=(1,))
    # The requested backend: with "auto" each device takes the one concrete_backend names.
    decode_step = jax.jit(functools.partial(model.decode_step, cfg=cfg, backend=args.backend,
                                            head_sharding=head_sharding), donate_argnums=(1,))
    reference_step = jax.jit(functools.partial(model.reference_step, cfg=cfg), donate_argnums=(1,))

    start = time.perf_counter()
    caches, first_tokens, rows = prefill(params, caches, block_tables, jax.device_put(tokens, place),
                                         jax.device_put(lens, place))
    jax.block_until_ready(first_tokens)
    print(f"prefill: {int(lens.sum())} prompt tokens, {time.perf_counter() - start:.2f} s "
          f"(compile included)")

    make_plan = functools.partial(step_plan, backend, cfg, max_pages=tables.shape[1], tp=args.tp,
                                  place=place)
    step_times, generated, record = decode(decode_step, make_plan, params, caches, block_tables,
                                           first_tokens, lens, args.steps, place)
    timed = step_times[1:]
    ms_per_step = 1e3 * sum(timed) / len(timed) if timed else float("nan")
    if timed:
        print(f"decode: {args.batch * 1e3 / ms_per_step:.1f} tokens/s, {ms_per_step:.2f} ms/step over "
              f"{len(timed)} steps after the first (first step, compile included: "
              f"{step_times[0]:.2f} s)")
    else:
        print(f"decode: one step, compile included: {step_times[0]:.2f} s; run --steps 2 or more "
              f"for a timing after compilation")
    print(f"request 0 generated tokens: {generated[0].tolist()}")

    # The check's own dense record of every token's [c_kv, k_pe], kept apart from the paged caches
    # (bf16 and unquantised, whatever --kv-dtype).
    max_len = args.prompt_len + args.steps
    histories = jax.device_put(
        [np.zeros((args.batch, max_len, r.shape[-1]), r.dtype) for r in rows], place)
    histories = [h.at[:, :args.prompt_len].set(r) for h, r in zip(histories, rows)]
    start = time.perf_counter()
    errors = check(reference_step, params, histories, record)
    check_s = time.perf_counter() - start
    max_error = max(errors)
    verdict = "OK" if max_error <= tolerance else "FAILED"
    against = " on the unquantised latents" if args.kv_dtype == fp8_cache.FP8 else ""
    print(f"check, every layer at every step: max relative error vs non-absorbed attention{against}: "
          f"{max_error:.3e} (tolerance {_format_tolerance(tolerance)}) {verdict}; {check_s:.2f} s, "
          "compile included")
    return {
        "max_error": max_error,
        "tolerance": tolerance,
        "backend": backend,
        "first_step_s": step_times[0],
        "ms_per_step": ms_per_step,
        "tokens_per_s": args.batch * 1e3 / ms_per_step if timed else float("nan"),
        "check_s": check_s,
        "tokens": generated,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if not result["max_error"] <= result["tolerance"]:
        print(f"error: absorbed decode differs from the non-absorbed reference by "
              f"{result['max_error']:.3e} > {_format_tolerance(result['tolerance'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
