"""The DeepSeek MLA example: the README's command, a v2-lite run, the absorbed-vs-naive check, one
compilation per step function, the fp8 cache (--kv-dtype fp8), progress output and configs."""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import json
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
FP8_TOLERANCE = deepseek_layer.FP8_TOLERANCE
ERROR_LINE = re.compile(r"max relative error vs non-absorbed attention(?: on the unquantised latents)?: "
                        r"(\S+) \(tolerance (\S+)\)")
BACKEND_LINE = re.compile(r"^backend (\S+) \((\S+)\) on .*$", re.MULTILINE)
# The README's first command, run with torch made unimportable: the example must not need it.
# Arguments after the script's path are passed on.
WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


def reported_error(stdout: str) -> float:
    match = ERROR_LINE.search(stdout)
    assert match, f"no error line in the output:\n{stdout}"
    return float(match.group(1))


def reported_tolerance(stdout: str) -> float:
    match = ERROR_LINE.search(stdout)
    assert match, f"no error line in the output:\n{stdout}"
    return float(match.group(2))


def run_example(*args: str) -> subprocess.CompletedProcess:
    """``python examples/deepseek_layer.py ARGS`` in a subprocess, in a log (not a terminal). Where
    only the xla backend runs, torch is made unimportable: the example needs none (FlashInfer's GPU
    modules do, so a machine that runs fa3/fa2 keeps it)."""
    root = os.path.dirname(EXAMPLES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    script = os.path.join("examples", "deepseek_layer.py")
    without_torch = jax_mla.available_backends()[0] == "xla"
    command = [sys.executable, "-c", WITHOUT_TORCH] if without_torch else [sys.executable]
    return subprocess.run([*command, script, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_readme_command_runs_the_tiny_default():
    """``python examples/deepseek_layer.py`` as the README runs it."""
    proc = run_example()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert reported_error(proc.stdout) < TOLERANCE
    assert reported_tolerance(proc.stdout) == TOLERANCE
    assert "config tiny" in proc.stdout and "tokens/s" in proc.stdout
    # Progress in a log: a few plain lines per loop, no carriage returns.
    assert "\r" not in proc.stdout + proc.stderr
    assert 1 <= proc.stderr.count("decode ") <= 4, proc.stderr
    assert "fp8" not in proc.stdout  # bf16 by default


def test_fp8_cache_run_is_checked_against_the_unquantised_latents():
    """``--kv-dtype fp8``: the layers' caches are fp8, backend auto decodes them on xla (whatever
    the machine: sm90 takes pages of 32 or 64 tokens, the default is 16), and the error against the
    non-absorbed
    attention on the unquantised latents stays within the fp8 tolerance, which is looser than
    bf16's but well under the error of a wrong softmax scale (about 0.3, the test below)."""
    proc = run_example("--kv-dtype", "fp8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    backend_line = BACKEND_LINE.search(proc.stdout)
    assert backend_line, proc.stdout
    assert backend_line.group(1, 2) == ("xla", "auto"), backend_line.group(0)
    assert "fp8 cache (656 B/token vs bf16's 1152; auto runs it on xla" in backend_line.group(0)
    assert "on the unquantised latents" in proc.stdout
    assert reported_tolerance(proc.stdout) == FP8_TOLERANCE > TOLERANCE
    # The quantisation shows (the bf16 cache's run errs 6e-3 to 8e-3), within the stated tolerance.
    assert TOLERANCE / 4 < reported_error(proc.stdout) < FP8_TOLERANCE
    assert f"(tolerance {FP8_TOLERANCE:.1e}) OK" in proc.stdout


@contextlib.contextmanager
def compilations():
    """Counts XLA compilations by function name (``jit(decode_step)``) while the block runs."""
    counts = collections.Counter()

    def listener(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            counts[kwargs.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def committed_plan_stand_in(monkeypatch):
    """Where the backend takes no plan (xla), give each step what ``jax_mla.plan`` gives the fa3/fa2
    ones: a fresh workspace committed to a device, which the step reads."""
    real_decode = jax_mla.decode

    def fake_plan(*args, **kwargs):
        return jax.device_put(np.zeros(64, np.uint8), jax.devices()[0])

    def decode_reading_the_plan(*args, plan, **kwargs):
        out = real_decode(*args, **kwargs)
        return out + jnp.zeros_like(out) * plan[0]  # a plan no computation reads is pruned by jit

    monkeypatch.setattr(deepseek_layer, "step_plan", fake_plan)
    monkeypatch.setattr(model.jax_mla, "decode", decode_reading_the_plan)


TWO_DEVICES = pytest.mark.skipif(jax.device_count() < 2,
                                 reason="needs two devices (conftest asks for 4 host devices)")


@pytest.mark.parametrize("tp,plan,kv_dtype", [
    (1, "as here", "bf16"),
    (1, "committed stand-in", "bf16"),
    pytest.param(2, "as here", "bf16", marks=TWO_DEVICES),
    (1, "as here", "fp8"),
    pytest.param(2, "as here", "fp8", marks=TWO_DEVICES),
])
def test_each_step_function_compiles_once(tp, plan, kv_dtype, monkeypatch, capsys):
    """Steps after the first reuse the first step's executables, so the timed steps compile nothing.
    With --tp 2 the query's heads split over two devices, each running the kernel on its 8 heads."""
    if plan == "committed stand-in":
        committed_plan_stand_in(monkeypatch)
    argv = ["--batch", "2", "--prompt-len", "12", "--steps", "4", "--layers", "1", "--tp", str(tp),
            "--kv-dtype", kv_dtype]
    with compilations() as counts:
        assert deepseek_layer.main(argv) == 0
    steps = {name: counts[f"jit({name})"] for name in ("prefill", "decode_step", "reference_step")}
    assert steps == {"prefill": 1, "decode_step": 1, "reference_step": 1}, counts
    out = capsys.readouterr().out
    assert f"tp {tp}," in out and reported_error(out) < deepseek_layer.TOLERANCES[kv_dtype]
    assert ("fp8 cache" in out) == (kv_dtype == "fp8")


def test_v2_lite_config(capsys):
    argv = ["--config", "v2-lite", "--batch", "2", "--prompt-len", "16", "--steps", "2", "--layers", "1"]
    assert deepseek_layer.main(argv) == 0
    out = capsys.readouterr().out
    assert "plain wq" in out  # V2-Lite has no q-LoRA
    assert reported_error(out) < TOLERANCE


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_run_fails_when_the_absorbed_path_is_wrong(kv_dtype, monkeypatch, capsys):
    """A decode that forgets YaRN's mscale**2 must make the script exit non-zero, also against the
    fp8 cache's looser tolerance."""
    real_decode = jax_mla.decode

    def decode_without_mscale(*args, softmax_scale, **kwargs):
        return real_decode(*args, softmax_scale=softmax_scale / model.CONFIGS["tiny"].yarn_mscale ** 2,
                           **kwargs)

    monkeypatch.setattr(model.jax_mla, "decode", decode_without_mscale)
    argv = ["--batch", "2", "--prompt-len", "12", "--steps", "2", "--layers", "1", "--seed", "3",
            "--kv-dtype", kv_dtype]
    assert deepseek_layer.main(argv) == 1
    captured = capsys.readouterr()
    assert reported_error(captured.out) > deepseek_layer.TOLERANCES[kv_dtype]
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
    (["--config", "v4"], "expected one of tiny, v2-lite, v3 or the path of a config.json, got 'v4'"),
    (["--backend", "cuda"], "invalid choice: 'cuda'"),
    (["--prompt-len", "16384"], "exceeds the tiny config's max_seq_len 16384"),
    (["--kv-dtype", "fp16"], "invalid choice: 'fp16'"),
])
def test_cli_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        deepseek_layer.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tp_must_divide_the_heads():
    with pytest.raises(SystemExit):
        deepseek_layer.parse_args(["--tp", "3"])


@pytest.mark.parametrize("argv, devices", [
    (["--tp", "2"], "2"), (["--tp=+2"], "2"), (["--t", "4"], "4"), (["--tp", "2", "--tp", "3"], "3"),
    (["--tp", "1"], None), (["--tp", "0"], None), (["--tp"], None), (["--tp", "x"], None),
    (["--batch", "2"], None)])
def test_tp_asks_xla_for_host_devices_as_the_parser_reads_it(argv, devices, monkeypatch):
    """The pre-scan that runs before jax loads reads --tp in every spelling the full parser takes,
    and leaves what the full parser refuses to it."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/unused")
    deepseek_layer._host_devices_for_tp(argv)
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_dump_to=/tmp/unused"
    expected = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    assert flags[1:] == expected


# DeepSeek-V3's config.json, its attention and RoPE entries (the rest is not read).
V3_CONFIG_JSON = {
    "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_hidden_layers": 61, "vocab_size": 129280,
}


def test_config_json_gives_the_embedded_v3_attention(tmp_path):
    path = tmp_path / "DeepSeek-V3" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(V3_CONFIG_JSON))
    cfg = deepseek_layer.parse_args(["--config", str(path)]).config
    v3 = model.CONFIGS["v3"]
    assert cfg.name == "DeepSeek-V3"
    for field in ("dim", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "vocab_size"):
        assert getattr(cfg, field) == getattr(v3, field), field
    assert cfg.softmax_scale == pytest.approx(v3.softmax_scale)
    np.testing.assert_array_equal(model.rope_frequencies(cfg), model.rope_frequencies(v3))

    # V2-Lite style: no q-LoRA; and a config without YaRN keeps RoPE and the softmax scale plain.
    plain = dict(V3_CONFIG_JSON, q_lora_rank=None, rope_scaling=None)
    cfg = model.config_from_hf(plain)
    assert cfg.q_lora_rank == 0 and cfg.softmax_scale == pytest.approx(192 ** -0.5)
    np.testing.assert_allclose(model.rope_frequencies(cfg), 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64),
                               rtol=1e-6)


@pytest.mark.parametrize("edit,message", [
    (lambda hf: hf.pop("kv_lora_rank"), "not a DeepSeek MLA config, it lacks 'kv_lora_rank'"),
    (lambda hf: hf["rope_scaling"].update(mscale=0.5), "mscale 0.5 != mscale_all_dim 1.0 is not supported"),
    (lambda hf: hf.update(rope_scaling={"type": "dynamic", "factor": 2.0}), "'dynamic' is not supported"),
    (lambda hf: hf["rope_scaling"].pop("factor"), "rope_scaling of type yarn lacks 'factor'"),
    (lambda hf: hf["rope_scaling"].update(factor=0), "rope_scaling of type yarn factor must be a finite number >= 1, got 0"),
    (lambda hf: hf["rope_scaling"].update(original_max_position_embeddings="4096"),
     "original_max_position_embeddings must be an integer >= 1, got '4096'"),
    (lambda hf: hf["rope_scaling"].update(mscale=0, mscale_all_dim=None), "mscale_all_dim must be a finite number"),
    (lambda hf: hf.update(rope_theta=float("inf")), "rope_theta must be a finite number >= 1, got inf"),
    (lambda hf: hf.update(rope_scaling=["yarn"]), "rope_scaling must be an object or null, got list"),
    (lambda hf: hf.update(num_attention_heads="16"), "num_attention_heads must be an integer >= 1, got '16'"),
    (lambda hf: hf.update(num_attention_heads=None), "num_attention_heads must be an integer >= 1, got None"),
    (lambda hf: hf.update(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
    (lambda hf: hf.update(q_lora_rank=-1), "q_lora_rank must be an integer >= 0, got -1"),
    (lambda hf: hf.update(rope_theta="big"), "rope_theta must be a finite number >= 1, got 'big'"),
])
def test_config_json_rejects_what_the_example_cannot_run(edit, message, tmp_path, capsys):
    hf = json.loads(json.dumps(V3_CONFIG_JSON))
    edit(hf)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    with pytest.raises(SystemExit):
        deepseek_layer.parse_args(["--config", str(path)])
    assert message in capsys.readouterr().err


def test_config_json_must_hold_an_object(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        deepseek_layer.parse_args(["--config", str(path)])
    assert "a config.json holds an object, got list" in capsys.readouterr().err


def test_fp8_cache_needs_whole_scale_groups(tmp_path, capsys):
    """The fp8 cache keeps one scale per 128 latent channels: a kv_lora_rank of 320 is refused when
    the arguments are parsed, not deep in the first step."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(V3_CONFIG_JSON, kv_lora_rank=320)))
    assert deepseek_layer.parse_args(["--config", str(path)]).kv_dtype == "bf16"
    with pytest.raises(SystemExit) as exit_info:
        deepseek_layer.parse_args(["--config", str(path), "--kv-dtype", "fp8"])
    assert exit_info.value.code == 2
    message = "--kv-dtype fp8: an fp8 cache needs kv_lora_rank to be a multiple of 128"
    assert message in capsys.readouterr().err


def test_help_explains_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        deepseek_layer.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("'tiny' (embedded default", "'v2-lite'", "'v3'", "HuggingFace config.json",
                  "DeepSeek-V3", "(default: tiny)", "--kv-dtype {bf16,fp8}", "decodes on xla",
                  "docs/fp8-cache.md", f"{FP8_TOLERANCE:.1e} for fp8", "(default: bf16)"):
        assert words in text, words


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_terminal_and_writes_a_few_plain_lines_to_a_log():
    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        progress = deepseek_layer.Progress(100, "decode", stream=stream)
        for done in range(1, 101):
            progress.update(done, f"note {done}")
        progress.close()
    assert terminal.getvalue().count("\r") == 100 and terminal.getvalue().endswith("100/100 note 100\n")
    assert log.getvalue().splitlines() == [f"decode {n}/100 note {n}" for n in (25, 50, 75, 100)]

    short = io.StringIO()
    progress = deepseek_layer.Progress(2, "check", stream=short)
    progress.update(1)
    progress.update(2)
    progress.close()
    assert short.getvalue() == "check 1/2\ncheck 2/2\n"


def test_the_backend_line_names_what_each_device_runs_on_hopper(monkeypatch):
    """On an SM90 GPU "auto" runs the fp8 cache on sm90 per device where the pages hold 32 or 64
    tokens, else on xla; the bf16 cache on sm90 where it is the faster one for the shard's heads
    and batch, else on fa3 (then with a plan)."""
    from jax_mla import backends

    monkeypatch.setattr(backends, "available_backends",
                        lambda platform=None: ["fa3", "fa2", "sm90", "xla"])
    monkeypatch.setattr(backends.gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = model.CONFIGS["tiny"]  # 16 heads

    def runs(kv_dtype, page_size, tp, batch=4, config=cfg):
        args = deepseek_layer.parse_args(["--kv-dtype", kv_dtype, "--page-size", str(page_size)])
        args.tp, args.batch = tp, batch
        shard = deepseek_layer.shard_shapes(config, args, num_pages=40, max_pages=8)
        return deepseek_layer.concrete_backend("auto", kv_dtype, shard)

    assert runs("fp8", 64, tp=1) == "sm90"
    assert runs("fp8", 32, tp=2) == "sm90"
    assert runs("fp8", 16, tp=1) == "xla"
    assert runs("bf16", 64, tp=1, batch=64) == "sm90"
    assert runs("bf16", 16, tp=1, batch=64) == "fa3"  # a page size sm90 does not take
    v3 = model.CONFIGS["v3"]  # 128 heads
    assert runs("bf16", 64, tp=1, batch=256, config=v3) == "sm90"
    assert runs("bf16", 64, tp=1, batch=7, config=v3) == "fa3"  # fa3 faster at 7 requests
    assert runs("bf16", 64, tp=2, batch=7, config=v3) == "sm90"  # 64 heads
