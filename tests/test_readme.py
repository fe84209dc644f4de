"""The README's promises that a CPU machine can check: its end-to-end snippet runs and is right,
its backend table lists exactly the backends of ``jax_mla.backends.TABLE``, its table of where
"auto" takes sm90 is ``backends.prefers_sm90``, and its sm90 table is what the committed benchmark
results give."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from conftest import relative_error
from jax_mla import backends
from jax_mla.reference import reference_from_jax

README = (Path(__file__).parent.parent / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_end_to_end_snippet_runs_and_matches_the_reference():
    snippet = next(block for block in python_blocks() if "def decode_step" in block)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    # Token t of request b is row i of latent/k_rope, in request order, at its page's offset.
    cache, rows = np.asarray(scope["cache"], np.float32), np.concatenate(
        [np.asarray(scope["latent"], np.float32), np.asarray(scope["k_rope"], np.float32)], axis=1)
    tables, page = scope["tables"], scope["PAGE"]
    written = [(b, t) for b, n in enumerate(scope["lengths"]) for t in range(n)]
    assert len(written) == len(rows)
    for i, (b, t) in enumerate(written):
        np.testing.assert_array_equal(cache[tables[b, t // page], t % page], rows[i])
    assert len(scope["outs"]) == scope["LAYERS"]
    for layer, out in enumerate(scope["outs"]):
        expected, _ = reference_from_jax(scope["queries"][layer], scope["cache"], scope["block_tables"],
                                         scope["seq_lens"], softmax_scale=192 ** -0.5)
        assert out.shape == (4, 1, 16, 512)
        assert relative_error(np.asarray(out, np.float32), expected.numpy()) < 2e-2


def test_backend_table_matches_the_code():
    section = README.split("\n## Backends\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", section, flags=re.M)
    listed = {name: where.strip() for name, where in rows}
    assert list(listed) == [backend.name for backend in backends.TABLE]
    for backend in backends.TABLE:
        assert listed[backend.name] == backend.runs_on


def test_sm90_table_is_the_committed_results_summary():
    import json

    from benchmarks import sm90_table

    results = Path(__file__).parent.parent / "benchmarks" / "results" / "h200-sm90-gpu-time.json"
    assert "h200-sm90-gpu-time.json" in README
    records = json.loads(results.read_text())["records"]
    assert sm90_table.summary(records) in README


def batches_of(cell: str) -> set[int] | None:
    """The batches a cell of the README's "auto" table names: "fa3" (none), "every batch",
    "from N", "N" or "N-M", or such cells joined by ", "."""
    if cell == "fa3":
        return set()
    if cell == "every batch":
        return set(range(1, 1025))
    if ", " in cell:
        return set().union(*(batches_of(part) for part in cell.split(", ")))
    if cell.startswith("from "):
        return set(range(int(cell[5:]), 1025))
    low, _, high = cell.partition("-")
    return set(range(int(low), int(high or low) + 1))


def test_auto_table_is_prefers_sm90():
    """Each cell names exactly the batches (1-1024) where "auto" takes sm90 for its heads and q_len."""
    section = README.split("\n## Backends\n", 1)[1].split("\n## ", 1)[0]
    table = section[section.index("| heads per device |"):].split("\n\n", 1)[0].splitlines()
    q_lens = [int(c.strip().removeprefix("q_len ")) for c in table[0].strip(" |").split("|")[1:]]
    assert q_lens == [1, 2, 3, 4]
    checked = 0
    for line in table[2:]:
        heads, *cells = [c.strip() for c in line.strip(" |").split("|")]
        for q_len, cell in zip(q_lens, cells, strict=True):
            actual = {b for b in range(1, 1025) if backends.prefers_sm90(b, q_len, int(heads))}
            assert actual == batches_of(cell), (heads, q_len, cell)
            checked += 1
    assert checked == 20
