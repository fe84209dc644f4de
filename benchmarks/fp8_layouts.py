"""fp8 cache layouts against the bf16 cache they are quantised from, in float32 on the CPU.

    python -m benchmarks.fp8_layouts [--problems 6] [--batch 8] [--heads 16] [--length 4096]

Each problem is the benchmark's data (benchmarks/problem.py): a bf16 cache and a bf16 query of
N(0, 1) values, DeepSeek-V3's softmax scale, ``--batch`` requests of ``--length`` tokens. Every
layout quantises the cache, is read back to float32 as its decoder defines it, and decodes in
float32; the table gives, per layout, the relative L2 distance of the whole output from the bf16
cache's output (median and worst over the problems) and the worst lse difference in nats. So it
measures the layouts alone, without any kernel's arithmetic; benchmarks.decode's flashinfer_fp8
and jax_mla_sm90_fp8 methods measure the kernels on them.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.peers import E4M3_MAX, dequantize_flashinfer_fp8, flashinfer_fp8_views
from benchmarks.problem import HEAD_DIM, KV_LORA_RANK, SOFTMAX_SCALE


def jax_mla_rows(torch, cache):
    """uint8 [T, 656]: jax_mla's fp8 cache rows of a bf16 cache [T, 576], as write_kv writes them."""
    import jax
    import jax.numpy as jnp

    from jax_mla import fp8_cache

    on_cpu = jax.device_put(cache.float().numpy(), jax.devices("cpu")[0])
    rows = on_cpu.astype(jnp.bfloat16)
    written = fp8_cache.quantize_rows(rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:])
    return torch.from_dlpack(written)


def max_scaled_groups(torch, latent):
    """float32 latent [T, 512] quantised with a max/448 scale per 128 channels, read back."""
    groups = latent.float().unflatten(-1, (-1, 128))
    amax = groups.abs().amax(-1, keepdim=True)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (groups / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (values * scales).flatten(-2)


def layouts(torch, cache) -> dict:
    """float32 [T, 576] read back from each layout of the bf16 cache [T, 576]."""
    from jax_mla.reference import dequantize_fp8

    rows = jax_mla_rows(torch, cache)
    rope = cache[:, KV_LORA_RANK:].float()
    flashinfer = {scales: dequantize_flashinfer_fp8(torch, *flashinfer_fp8_views(
        torch, cache, rows, scales)) for scales in ("group", "tensor")}
    e4m3_rope = flashinfer["tensor"][:, KV_LORA_RANK:]
    max_groups = max_scaled_groups(torch, cache[:, :KV_LORA_RANK])
    return {
        "jax_mla (write_kv): power-of-two scale per 128 latent channels, bf16 rope":
            dequantize_fp8(rows, KV_LORA_RANK),
        "max/448 scale per 128 latent channels, bf16 rope": torch.cat([max_groups, rope], -1),
        "FlashInfer: jax_mla's latent bytes and scales (ckv_scale_arr), e4m3 rope (kpe_scale)":
            flashinfer["group"],
        "FlashInfer: max/448 scale per 128 latent channels (ckv_scale_arr), e4m3 rope":
            torch.cat([max_groups, e4m3_rope], -1),
        "FlashInfer: one scale per tensor (ckv_scale), e4m3 rope (kpe_scale)":
            flashinfer["tensor"],
    }


def decode(torch, query, cache, batch: int):
    """jax_mla's float32 torch reference on one page per request: query [B, H, 576], cache
    [B * L, 576] (request b: rows [b * L, (b + 1) * L)) -> (out [B, 1, H, 512], lse [B, 1, H])."""
    from jax_mla.reference import mla_decode_reference

    pages = cache.float().unflatten(0, (batch, -1))
    return mla_decode_reference(query[:, None], pages, torch.arange(batch)[:, None],
                                torch.full((batch,), pages.shape[1]), softmax_scale=SOFTMAX_SCALE)


def measure(problems: int, batch: int, heads: int, length: int) -> dict:
    """{layout: [(relative L2 of the output, max |lse difference|) per problem]}."""
    import torch

    results: dict[str, list] = {}
    for seed in range(problems):
        gen = torch.Generator().manual_seed(seed)
        cache = torch.randn(batch * length, HEAD_DIM, generator=gen).to(torch.bfloat16)
        query = torch.randn(batch, heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        ref_out, ref_lse = decode(torch, query, cache, batch)
        for name, read_back in layouts(torch, cache).items():
            out, lse = decode(torch, query, read_back, batch)
            l2 = float((out - ref_out).norm() / ref_out.norm())
            results.setdefault(name, []).append((l2, float((lse - ref_lse).abs().max())))
    return results


def table(results: dict) -> str:
    lines = ["| layout | relative L2 vs bf16: median | worst | lse vs bf16, worst (nats) |",
             "|---|---|---|---|"]
    for name, rows in results.items():
        l2s = [l2 for l2, _ in rows]
        lines.append(f"| {name} | {100 * statistics.median(l2s):.2f}% | {100 * max(l2s):.2f}% | "
                     f"{max(lse for _, lse in rows):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_layouts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    args = p.parse_args(argv)
    results = measure(args.problems, args.batch, args.heads, args.length)
    print(f"{args.problems} problems of {args.batch} requests x {args.heads} heads x {args.length} "
          f"tokens, N(0, 1) bf16 data, softmax_scale {SOFTMAX_SCALE}")
    print(table(results))


if __name__ == "__main__":
    main()
