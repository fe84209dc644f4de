"""The DeepSeek MLA example: the README's command, a v2-lite run, and the absorbed-vs-naive check."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import deepseek_layer  # noqa: E402
import deepseek_mla as model  # noqa: E402

import jax_mla  # noqa: E402

TOLERANCE = deepseek_layer.TOLERANCE
ERROR_LINE = re.compile(r"max relative error vs non-absorbed attention: (\S+)")


def reported_error(stdout: str) -> float:
    match = ERROR_LINE.search(stdout)
    assert match, f"no error line in the output:\n{stdout}"
    return float(match.group(1))


def test_readme_command_runs_the_tiny_default():
    """``python examples/deepseek_layer.py``, exactly as the README runs it."""
    root = os.path.dirname(EXAMPLES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join("examples", "deepseek_layer.py")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert reported_error(proc.stdout) < TOLERANCE
    assert "config tiny" in proc.stdout and "tokens/s" in proc.stdout


def test_v2_lite_config(capsys):
    argv = ["--config", "v2-lite", "--batch", "2", "--prompt-len", "16", "--steps", "2", "--layers", "1"]
    assert deepseek_layer.main(argv) == 0
    out = capsys.readouterr().out
    assert "plain wq" in out  # V2-Lite has no q-LoRA
    assert reported_error(out) < TOLERANCE


def test_run_fails_when_the_absorbed_path_is_wrong(monkeypatch, capsys):
    """A decode that forgets YaRN's mscale**2 must make the script exit non-zero."""
    real_decode = jax_mla.decode

    def decode_without_mscale(*args, softmax_scale, **kwargs):
        return real_decode(*args, softmax_scale=softmax_scale / model.CONFIGS["tiny"].yarn_mscale ** 2,
                           **kwargs)

    monkeypatch.setattr(model.jax_mla, "decode", decode_without_mscale)
    argv = ["--batch", "2", "--prompt-len", "12", "--steps", "2", "--layers", "1", "--seed", "3"]
    assert deepseek_layer.main(argv) == 1
    captured = capsys.readouterr()
    assert reported_error(captured.out) > TOLERANCE
    assert "differs from the non-absorbed reference" in captured.err


def one_layer_problem(cfg, seed=0, page_size=8, prompt_lens=(20, 7)):
    """A prefilled single layer: (params, cache, block_tables, dense history, next positions, x_new)."""
    rng = np.random.default_rng(seed)
    params = model.init_attention(rng, cfg)
    lens = np.asarray(prompt_lens, np.int32)
    tables, num_pages = deepseek_layer.assign_pages(rng, lens + 1, page_size)
    cache = jax_mla.allocate_cache(num_pages, page_size)
    batch, length = len(lens), int(lens.max())
    x = jnp.asarray(rng.standard_normal((batch, length, cfg.dim), np.float32), jnp.bfloat16)
    prefill = jax.jit(functools.partial(model.mla_prefill, cfg=cfg))
    _, cache, rows = prefill(params, x=x, kv_cache=cache, block_tables=jnp.asarray(tables),
                             prompt_lens=jnp.asarray(lens))
    history = jnp.zeros((batch, length + 1, rows.shape[-1]), rows.dtype).at[:, :length].set(rows)
    x_new = jnp.asarray(rng.standard_normal((batch, 1, cfg.dim), np.float32), jnp.bfloat16)
    return params, cache, jnp.asarray(tables), history, jnp.asarray(lens), x_new


def test_absorbed_layer_matches_naive_and_a_wrong_scale_fails():
    cfg = model.CONFIGS["tiny"]
    params, cache, tables, history, positions, x_new = one_layer_problem(cfg)
    decode = jax.jit(functools.partial(model.mla_decode, cfg=cfg), static_argnames="softmax_scale")
    reference = jax.jit(functools.partial(model.mla_reference, cfg=cfg))

    want, history = reference(params, x=x_new, history=history, positions=positions)
    got, new_cache = decode(params, x=x_new, kv_cache=cache, block_tables=tables, positions=positions)
    assert got.shape == want.shape == (2, 1, cfg.dim) and got.dtype == jnp.bfloat16
    assert deepseek_layer.relative_error(got, want) < TOLERANCE

    # The paged cache holds exactly the dense history's rows, the new token's included.
    paged_cache, dense = np.asarray(new_cache, np.float32), np.asarray(history, np.float32)
    page_size = paged_cache.shape[1]
    for b, seq_len in enumerate(np.asarray(positions) + 1):
        pages = np.asarray(tables)[b, :-(-seq_len // page_size)]
        paged = paged_cache[pages].reshape(-1, paged_cache.shape[-1])[:seq_len]
        np.testing.assert_array_equal(paged, dense[b, :seq_len])

    # A plausible bug: scaling by the absorbed head dim (kv_lora_rank + rope) instead of qk_head_dim.
    wrong, _ = decode(params, x=x_new, kv_cache=cache, block_tables=tables, positions=positions,
                      softmax_scale=(cfg.kv_lora_rank + cfg.qk_rope_head_dim) ** -0.5)
    assert deepseek_layer.relative_error(wrong, want) > TOLERANCE


def test_yarn_softmax_scale_and_frequencies():
    cfg = model.CONFIGS["v3"]
    mscale = 0.1 * np.log(40.0) + 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    freqs = model.rope_frequencies(cfg)
    plain = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    # correction range [10, 23] for beta_fast 32 / beta_slow 1 over 4096 positions
    np.testing.assert_allclose(freqs[:11], plain[:11], rtol=1e-6)  # fast dims kept
    np.testing.assert_allclose(freqs[23:], plain[23:] / 40.0, rtol=1e-6)  # slow dims interpolated
    assert np.all((freqs[11:23] < plain[11:23]) & (freqs[11:23] > plain[11:23] / 40.0))


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0"], "--batch: expected an integer >= 1"),
    (["--steps", "two"], "--steps: expected an integer"),
    (["--config", "v4"], "invalid choice: 'v4'"),
    (["--backend", "cuda"], "invalid choice: 'cuda'"),
    (["--prompt-len", "16384"], "exceeds the tiny config's max_seq_len 16384"),
])
def test_cli_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        deepseek_layer.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(jax.device_count() < 2, reason="needs two devices (conftest asks for 4 host devices)")
def test_tensor_parallel_heads(capsys):
    """--tp 2: the query's heads split over two devices, each running the kernel on its 8 heads."""
    assert deepseek_layer.main(["--tp", "2", "--steps", "2", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "tp 2" in out and reported_error(out) < TOLERANCE


def test_tp_must_divide_the_heads():
    with pytest.raises(SystemExit):
        deepseek_layer.parse_args(["--tp", "3"])
