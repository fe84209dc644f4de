"""A DeepSeek MLA attention stack prefilling and decoding on jax_mla, checked at every step.

    python examples/deepseek_layer.py                       # tiny config, seconds on a CPU
    python examples/deepseek_layer.py --config v2-lite --layers 4 --steps 32
    python examples/deepseek_layer.py --config v3 --batch 8 --prompt-len 1024   # wants a GPU

Requests of different prompt lengths share one pool of pages, handed out in shuffled order. Prompts
are prefilled with plain (non-absorbed) attention, which also writes their latent rows to the paged
caches; then every decode step runs the weight-absorbed path through ``jax_mla.decode`` in one jitted
function whose caches are donated, so ``jax_mla.write_kv`` updates them in place. After each step
every layer's output is recomputed non-absorbed over a dense copy of its history; the run fails
(exit 1) when the relative error exceeds bf16 tolerance. Weights are random (seeded); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time


def _host_devices_for_tp(argv: list[str]) -> None:
    """On a CPU, --tp N needs N host devices, which XLA only creates if told before jax loads."""
    for flag, value in zip(argv, argv[1:] + [""]):
        count = value if flag == "--tp" else flag.removeprefix("--tp=") if flag.startswith("--tp=") else ""
        if count.isdigit() and int(count) > 1 and "device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_force_host_platform_device_count={count}").strip()


_host_devices_for_tp(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepseek_mla as model  # noqa: E402

import jax_mla  # noqa: E402
from jax_mla import backends  # noqa: E402

# Max |absorbed - reference| over max |reference|, per layer and step: bf16 tolerance.
TOLERANCE = 2e-2


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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", choices=sorted(model.CONFIGS), default="tiny")
    parser.add_argument("--batch", type=positive_int, default=4, help="requests decoded together")
    parser.add_argument("--prompt-len", type=positive_int, default=48,
                        help="longest prompt; the others are shorter, at random")
    parser.add_argument("--steps", type=positive_int, default=16, help="decode steps")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per cache page")
    parser.add_argument("--backend", default="auto", choices=["auto", *backends.ALL_BACKENDS],
                        help="jax_mla backend; auto: the xla one on CPU, the FFI kernels on a GPU")
    parser.add_argument("--layers", type=positive_int, default=2, help="stacked attention layers")
    parser.add_argument("--seed", type=bounded_int(0), default=0, help="weights, prompts and pages")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor parallelism: split the attention heads over this many devices")
    args = parser.parse_args(argv)

    cfg = model.CONFIGS[args.config]
    if args.prompt_len + args.steps > cfg.max_seq_len:
        parser.error(f"--prompt-len + --steps = {args.prompt_len + args.steps} exceeds the "
                     f"{args.config} config's max_seq_len {cfg.max_seq_len}")
    if cfg.n_heads % args.tp:
        parser.error(f"--tp {args.tp} must divide the {args.config} config's {cfg.n_heads} heads")
    if args.tp > jax.device_count():
        parser.error(f"--tp {args.tp} needs {args.tp} devices, this machine has {jax.device_count()}")
    if args.backend != "auto" and args.backend not in (available := jax_mla.available_backends()):
        parser.error(f"--backend {args.backend} cannot run here ({jax.default_backend()}); "
                     f"available: {available}")
    return args


class Progress:
    """A one-line progress bar on stderr, redrawn in place."""

    def __init__(self, total: int, label: str, width: int = 24, stream=sys.stderr):
        self.total, self.label, self.width, self.stream = total, label, width, stream

    def update(self, done: int, note: str = "") -> None:
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        sys.stdout.flush()  # keep stdout lines ahead of the bar when both go to one terminal
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {note}")
        self.stream.flush()

    def close(self) -> None:
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


def describe(cfg: model.MLAConfig, args: argparse.Namespace, backend: str) -> str:
    q_path = f"q_lora_rank {cfg.q_lora_rank}" if cfg.q_lora_rank else "plain wq"
    return (f"config {cfg.name}: dim {cfg.dim}, {cfg.n_heads} heads, {q_path}, kv_lora_rank "
            f"{cfg.kv_lora_rank}, qk_nope {cfg.qk_nope_head_dim}, qk_rope {cfg.qk_rope_head_dim}, "
            f"v_head {cfg.v_head_dim}; softmax_scale {cfg.softmax_scale:.5f} (YaRN mscale "
            f"{cfg.yarn_mscale:.4f})\n"
            f"backend {backend} ({args.backend}) on {jax.default_backend()}, tp {args.tp}, "
            f"{args.layers} layer(s), "
            f"bf16")


def make_requests(rng: np.random.Generator, cfg: model.MLAConfig, args: argparse.Namespace):
    """Random prompts and their pages: (prompt lengths int32 [B], padded prompt tokens int32 [B, P],
    block_tables int32 [B, max_pages], num_pages)."""
    lens = prompt_lengths(rng, args.batch, args.prompt_len)
    tables, num_pages = assign_pages(rng, lens + args.steps, args.page_size)
    tokens = rng.integers(0, cfg.vocab_size, size=(args.batch, args.prompt_len)).astype(np.int32)
    tokens[np.arange(args.prompt_len)[None, :] >= lens[:, None]] = 0  # padding
    return lens, tokens, tables, num_pages


def step_plan(backend: str, cfg: model.MLAConfig, seq_lens: np.ndarray, max_pages: int,
              mesh=None):
    """The fa3/fa2 work schedule for one step's lengths, built on the host and shared by every
    layer (None for the other backends, which need none). Under tensor parallelism it is built for
    the per-device head count and replicated over the mesh."""
    if backends.resolve(backend, jax.default_backend()) not in (backends.FA3, backends.FA2):
        return None
    tp = 1 if mesh is None else mesh.shape["tp"]
    plan = jax_mla.plan(seq_lens, num_heads=cfg.n_heads // tp, max_pages=max_pages,
                        kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim)
    return plan if mesh is None else jax.device_put(plan, NamedSharding(mesh, PartitionSpec()))


def decode_and_check(decode_step, reference_step, make_plan, params, caches, histories, block_tables,
                     first_tokens, prompt_lens: np.ndarray, steps: int):
    """Run ``steps`` decode steps, checking every layer after each one against the reference.

    ``make_plan(seq_lens)`` gives the step's ``jax_mla.Plan`` (or None) from host lengths.

    Returns (seconds per step, max relative error per step, generated tokens int32 [B, steps + 1]
    starting with ``first_tokens``).
    """
    step_times, errors, generated = [], [], [np.asarray(first_tokens)]
    tokens = first_tokens
    progress = Progress(steps, "decode")
    for step in range(steps):
        host_positions = prompt_lens + step
        positions = jnp.asarray(host_positions)
        start = time.perf_counter()
        plan = make_plan(host_positions + 1)
        caches, tokens, attn_inputs, attn_outputs = decode_step(params, caches, block_tables, tokens,
                                                                positions, plan)
        jax.block_until_ready(tokens)
        step_times.append(time.perf_counter() - start)

        histories, expected = reference_step(params, histories, attn_inputs, positions)
        errors.append(max(relative_error(got, want)
                          for got, want in zip(np.asarray(attn_outputs), np.asarray(expected))))
        generated.append(np.asarray(tokens))
        progress.update(step + 1, f"max rel err {max(errors):.2e}")
    progress.close()
    return step_times, errors, np.stack(generated, axis=1)


def run(args: argparse.Namespace) -> dict:
    """Prefill, decode and check. Returns max_error, ms_per_step, tokens_per_s (NaN for a single
    step), first_step_s and the generated tokens [B, steps + 1]."""
    cfg = model.CONFIGS[args.config]
    rng = np.random.default_rng(args.seed)
    lens, tokens, tables, num_pages = make_requests(rng, cfg, args)
    backend = backends.resolve(args.backend, jax.default_backend())
    print(describe(cfg, args, backend))
    print(f"{args.batch} requests, prompt lengths {lens.tolist()}, {args.steps} decode steps; "
          f"{num_pages} pages of {args.page_size} tokens per layer, shuffled")

    params = model.init_model(args.seed, cfg, args.layers)
    block_tables = jnp.asarray(tables)
    caches = [jax_mla.allocate_cache(num_pages, args.page_size, kv_lora_rank=cfg.kv_lora_rank,
                                     rope_dim=cfg.qk_rope_head_dim) for _ in range(args.layers)]
    mesh = head_sharding = None
    if args.tp > 1:
        # Weights, caches and tables replicated; the attention heads split over the "tp" axis.
        mesh = jax.make_mesh((args.tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
        replicated = NamedSharding(mesh, PartitionSpec())
        params, caches, block_tables = jax.device_put((params, caches, block_tables), replicated)
        head_sharding = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
    # Donated caches (and histories) are updated in place instead of copied every step.
    prefill = jax.jit(functools.partial(model.prefill, cfg=cfg), donate_argnums=(1,))
    decode_step = jax.jit(functools.partial(model.decode_step, cfg=cfg, backend=backend,
                                            head_sharding=head_sharding), donate_argnums=(1,))
    reference_step = jax.jit(functools.partial(model.reference_step, cfg=cfg), donate_argnums=(1,))

    start = time.perf_counter()
    caches, first_tokens, rows = prefill(params, caches, block_tables, jnp.asarray(tokens),
                                         jnp.asarray(lens))
    jax.block_until_ready(first_tokens)
    print(f"prefill: {int(lens.sum())} prompt tokens, {time.perf_counter() - start:.2f} s "
          f"(compile included)")

    # The check's own dense record of every token's [c_kv, k_pe], kept apart from the paged caches.
    max_len = args.prompt_len + args.steps
    histories = [jnp.zeros((args.batch, max_len, r.shape[-1]), r.dtype).at[:, :args.prompt_len].set(r)
                 for r in rows]
    make_plan = functools.partial(step_plan, backend, cfg, max_pages=tables.shape[1], mesh=mesh)
    step_times, errors, generated = decode_and_check(
        decode_step, reference_step, make_plan, params, caches, histories, block_tables,
        first_tokens, lens, args.steps)

    timed = step_times[1:]  # the first step includes compilation
    ms_per_step = 1e3 * sum(timed) / len(timed) if timed else float("nan")
    result = {
        "max_error": max(errors),
        "ms_per_step": ms_per_step,
        "tokens_per_s": args.batch * 1e3 / ms_per_step if timed else float("nan"),
        "first_step_s": step_times[0],
        "tokens": generated,
    }
    print(f"request 0 generated tokens: {generated[0].tolist()}")
    verdict = "OK" if result["max_error"] <= TOLERANCE else "FAILED"
    print(f"max relative error vs non-absorbed attention: {result['max_error']:.3e} "
          f"(tolerance {TOLERANCE:.0e}) {verdict}")
    if timed:
        print(f"decode: {result['tokens_per_s']:.1f} tokens/s, {ms_per_step:.2f} ms/step over "
              f"{len(timed)} steps after the first (compile: {step_times[0]:.2f} s)")
    else:
        print("decode: one step only; run --steps 2 or more for a timing after compilation")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if not result["max_error"] <= TOLERANCE:
        print(f"error: absorbed decode differs from the non-absorbed reference by "
              f"{result['max_error']:.3e} > {TOLERANCE:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
