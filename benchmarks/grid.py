"""The benchmark grid: its points, the named grids, ``--points`` filters and the split into pieces."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Point:
    """One benchmark point: batch, mean kv length, heads, query tokens per request, page size."""

    B: int
    L: int
    H: int
    q_len: int
    page_size: int

    @property
    def key(self) -> str:
        return f"B{self.B}-L{self.L}-H{self.H}-q{self.q_len}-p{self.page_size}"

    @property
    def label(self) -> str:
        return f"B={self.B} L={fmt_len(self.L)} H={self.H} q={self.q_len} p={self.page_size}"


def fmt_len(n: int) -> str:
    """4096 -> '4k'; lengths that are not whole multiples of 1024 stay as they are."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def parse_len(text: str) -> int:
    """'4k' -> 4096, '96' -> 96."""
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def full_grid() -> list[Point]:
    points = [Point(b, l, h, q, 64)
              for h in (16, 128) for q in (1, 2) for b in (1, 32, 128, 512)
              for l in (1024, 4096, 16384, 32768)]
    return points + page32_grid()


def page32_grid() -> list[Point]:
    return [Point(b, l, h, 1, 32) for h in (16, 128) for b in (32, 128) for l in (4096, 16384)]


def heads_grid() -> list[Point]:
    """Head counts between the full grid's 16 and 128 (DeepSeek-V3 over TP 2-16, 64-head models),
    at q_len 1 and 2 (multi-token prediction's one draft token)."""
    return [Point(b, l, h, q, 64) for h in (8, 32, 64) for q in (1, 2) for b in (32, 128)
            for l in (4096, 16384)]


def batches_grid() -> list[Point]:
    """128 heads (one device's share under data-parallel attention) at batches between the full
    grid's 32, 128 and 512."""
    return [Point(b, l, 128, 1, 64) for b in (64, 256) for l in (1024, 4096, 16384)]


def quick_grid() -> list[Point]:
    return [Point(1, 1024, 128, 1, 64), Point(32, 4096, 128, 1, 64), Point(128, 4096, 16, 1, 64),
            Point(128, 4096, 128, 2, 64), Point(128, 16384, 128, 1, 64), Point(512, 4096, 128, 1, 64)]


def dry_grid() -> list[Point]:
    return [Point(1, 64, 4, 1, 16), Point(3, 96, 2, 2, 32)]


GRIDS = {"full": full_grid, "quick": quick_grid, "page32": page32_grid, "heads": heads_grid,
         "batches": batches_grid, "dry": dry_grid}

_FIELDS = {"b": "B", "l": "L", "h": "H", "q": "q_len", "q_len": "q_len", "p": "page_size",
           "page": "page_size", "page_size": "page_size"}


def parse_point_filters(specs: list[str]) -> list[dict[str, set[int]]]:
    """``--points 'B=128,L=4k|16k,H=16'`` (repeatable, ';' = or; a point matching any spec is kept)."""
    filters = []
    for spec in specs:
        for part in spec.split(";"):
            if not part.strip():
                continue
            f: dict[str, set[int]] = {}
            for item in part.split(","):
                if "=" not in item:
                    raise SystemExit(f"--points: expected NAME=VALUE[|VALUE...], got {item!r}")
                name, values = item.split("=", 1)
                field = _FIELDS.get(name.strip().lower())
                if field is None:
                    raise SystemExit(f"--points: unknown field {name!r} (use B, L, H, q, page)")
                if field in f:
                    raise SystemExit(f"--points: {name.strip()!r} given twice in {part.strip()!r} "
                                     "(list its values as A|B)")
                try:
                    f[field] = {parse_len(v) for v in values.split("|")}
                except ValueError:
                    raise SystemExit(f"--points: {name.strip()} needs integers (4k = 4096) "
                                     f"separated by |, got {values!r}") from None
            filters.append(f)
    return filters


def point_matches(pt: Point, filters) -> bool:
    return not filters or any(all(getattr(pt, k) in v for k, v in f.items()) for f in filters)


def split_pieces(points: list[Point], costs: dict[Point, float], n: int) -> list[list[Point]]:
    """Longest-processing-time split into n pieces of similar estimated cost (deterministic)."""
    pieces: list[list[Point]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for pt in sorted(points, key=lambda p: (-costs[p], p)):
        i = min(range(n), key=lambda j: (loads[j], j))
        pieces[i].append(pt)
        loads[i] += costs[pt]
    return [sorted(p, key=lambda q: (costs[q], q)) for p in pieces]
