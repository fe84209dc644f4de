"""Two builds of the sm90 kernel side by side in the standalone harness
(benchmarks/sm90_harness.cu): the working tree ("new") against a git revision ("base").

On the CPU machine, build both (nvcc, sm_90a; about a minute each), and any other revisions to
time beside them (a branch with a variant, say):

    python -m benchmarks.sm90_ab build BASE_REV [--variant NAME=REV ...]
        # .gpu/sm90_harness{,_base,_lineinfo}, and .gpu/sm90_harness_NAME from REV

then on the GPU machine (carry .gpu), the new build's checks and sanitizers, and the builds timed
point by point, alternating (every other pass in reverse order), over several passes:

    python -m benchmarks.sm90_ab run [--checks] [--passes 2] [--points "B,L,H,q_len,iters,dist;..."]
                                     [--variants NAME,...]

which writes $OUT/sm90-ab.log (the harness's rows, variant "base", "new" or NAME) and prints, per
point, each build's µs per layer in every pass and its mean time over base's.
`table LOG` prints that table again from a log. The harness's own flags (e.g. --cluster1) go
after `--`.

`same-code REV` (CPU machine) compiles the harness of the working tree and of REV to cubins and
says which kernels' machine code differs (their code, static shared memory, parameters, launch
attributes, registers and stack compared byte for byte): a refactor that moves code should change
none.
"""

from __future__ import annotations

import argparse
import os
import runpy
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_DIR = os.path.join(ROOT, ".gpu")
NEW, BASE, LINEINFO = (os.path.join(GPU_DIR, name) for name in
                       ("sm90_harness", "sm90_harness_base", "sm90_harness_lineinfo"))

# B, L, H, q_len, iters, dist: B = 1-4 and short lengths, where a layer is tens of µs, then the
# 128-head and 16-head points the targets name.
DEFAULT_POINTS = ("1,4096,128,1,3000,fixed;1,4096,16,1,3000,fixed;1,16384,128,1,2000,fixed;"
                  "4,4096,128,1,2000,uniform;32,4096,128,1,1000,uniform;"
                  "128,1024,128,1,800,uniform;128,4096,128,1,300,uniform;"
                  "32,16384,16,1,400,uniform;128,4096,16,1,500,uniform")


def cutlass_include() -> str:
    """CUTLASS headers, looked up as ffi/CMakeLists.txt does (ffi/find_cutlass.py)."""
    finder = runpy.run_path(os.path.join(ROOT, "ffi", "find_cutlass.py"))
    found = finder["configured_cutlass_include"]()
    if not found:
        raise SystemExit("no CUTLASS headers: set CUTLASS_INCLUDE_DIR or install nvidia-cutlass")
    return found


def nvcc(tree: str, output: str, *extra: str) -> None:
    """The harness of `tree` built for sm_90a into `output`."""
    cmd = ["nvcc", "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", *extra,
           f"-I{tree}", f"-I{cutlass_include()}", "--expt-relaxed-constexpr",
           os.path.join(tree, "benchmarks", "sm90_harness.cu"), "-o", output]
    subprocess.run(cmd, check=True)


def variant_binary(name: str) -> str:
    return os.path.join(GPU_DIR, f"sm90_harness_{name}")


def check_variant_names(names: list[str]) -> list[str]:
    """The names, each a word other than the three builds' own and named once: the harness rows
    and the table tell the builds apart by them."""
    for name in names:
        if not name.isidentifier() or name in ("base", "new", "lineinfo"):
            raise SystemExit(f"a variant's name is a word other than base, new and lineinfo; "
                             f"got {name!r}")
    if len(set(names)) != len(names):
        raise SystemExit(f"each variant is named once; got {', '.join(names)}")
    return names


def parse_variants(specs: list[str]) -> list[tuple[str, str]]:
    """NAME=REV items as (name, rev)."""
    variants = []
    for spec in specs:
        name, sep, rev = spec.partition("=")
        if not sep or not rev or rev.startswith("-"):
            raise SystemExit(f"a variant is NAME=REV with REV a git revision; got {spec!r}")
        variants.append((name, rev))
    check_variant_names([name for name, _ in variants])
    return variants


def nvcc_at(rev: str, output: str, *extra: str) -> None:
    """The harness of git revision `rev` built into `output`."""
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "ffi", "benchmarks"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        nvcc(tree, output, *extra)


def elf_sections(path: str) -> dict[str, bytes]:
    """Each section of a 64-bit little-endian ELF file (a cubin) by name: its bytes, or for a
    section without file contents (NOBITS: .nv.shared.*) its size as text."""
    data = open(path, "rb").read()
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit(f"{path} is not a 64-bit little-endian ELF file")
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, section_offset + i * entry_size)
               for i in range(count)]
    names_offset = headers[names_index][4]
    sections = {}
    for name_offset, kind, _, _, offset, size in headers:
        start = names_offset + name_offset
        name = data[start:data.index(b"\0", start)].decode()
        sections[name] = f"NOBITS {size}".encode() if kind == 8 else data[offset:offset + size]
    return sections


def symbol_names(sections: dict[str, bytes]) -> list[str]:
    """The names of the cubin's symbols in symbol-table order (an index names one)."""
    table, names = sections.get(".symtab", b""), sections.get(".strtab", b"")
    return [names[name:names.index(b"\0", name)].decode()
            for name, in struct.iter_unpack("<I20x", table)]


def info_entries(info: bytes) -> list[tuple[int, bytes]]:
    """The entries of an .nv.info section as (attribute, value): format 4 entries carry a 16-bit
    size and that many bytes, the others a 16-bit value."""
    entries, i = [], 0
    while i + 4 <= len(info):
        form, attribute, value = info[i], info[i + 1], info[i + 2:i + 4]
        if form == 4:
            size, = struct.unpack("<H", value)
            value = info[i + 4:i + 4 + size]
            i += size
        entries.append((attribute, value))
        i += 4
    return entries


# Attributes whose value starts with a symbol index: the kernel's parameter bank in its own
# .nv.info section (EIATTR_PARAM_CBANK), and in the cubin-wide .nv.info each function's register
# count, frame size and minimum stack size (EIATTR_REGCOUNT, _FRAME_SIZE, _MIN_STACK_SIZE).
PARAM_BANK = 0x0A
PER_FUNCTION_ATTRIBUTES = (0x2F, 0x11, 0x12)


def kernel_signatures(sections: dict[str, bytes]) -> dict[str, bytes]:
    """Per kernel (mangled name): its machine code, static shared memory, constant bank (its
    parameters), its launch attributes (.nv.info.<kernel>) and its register count and stack sizes,
    symbol indices replaced by names, which shift when another kernel comes or goes."""
    names = symbol_names(sections)

    def named(value: bytes) -> bytes:
        index, = struct.unpack_from("<I", value)
        return names[index].encode() + value[4:] if index < len(names) else value

    signatures: dict[str, list[bytes]] = {}
    for section, contents in sorted(sections.items()):
        for prefix in (".text.", ".nv.shared.", ".nv.constant0.", ".nv.info."):
            if section.startswith(prefix) and not section.startswith(".nv.shared.reserved."):
                if prefix == ".nv.info.":
                    contents = b"".join(bytes([a]) + (named(v) if a == PARAM_BANK else v)
                                        for a, v in info_entries(contents))
                signatures.setdefault(section[len(prefix):], []).append(
                    prefix.encode() + contents)
    for attribute, value in info_entries(sections.get(".nv.info", b"")):
        if attribute in PER_FUNCTION_ATTRIBUTES and len(value) >= 4:
            index, = struct.unpack_from("<I", value)
            if index < len(names) and names[index] in signatures:
                signatures[names[index]].append(bytes([attribute]) + value[4:])
    return {kernel: b"\0".join(parts) for kernel, parts in signatures.items()}


def kernels_differing(old: dict[str, bytes], new: dict[str, bytes]) -> tuple[int, list[str]]:
    """How many kernels two cubins' sections (elf_sections) hold between them, and those whose
    signatures (kernel_signatures) differ or that exist in only one of them."""
    old_kernels, new_kernels = kernel_signatures(old), kernel_signatures(new)
    kernels = old_kernels.keys() | new_kernels.keys()
    return len(kernels), sorted(k for k in kernels if old_kernels.get(k) != new_kernels.get(k))


def same_code(rev: str) -> int:
    """Prints which kernels of the harness compile to other machine code in the working tree
    than at `rev`; 0 when none does."""
    with tempfile.TemporaryDirectory() as tmp:
        old, new = os.path.join(tmp, "old.cubin"), os.path.join(tmp, "new.cubin")
        nvcc_at(rev, old, "-cubin")
        nvcc(ROOT, new, "-cubin")
        total, differing = kernels_differing(elf_sections(old), elf_sections(new))
    print(f"{total} kernels, {total - len(differing)} with the same machine code as {rev}")
    for name in differing:
        print(f"  differs: {name}")
    return 1 if differing else 0


def build(base_rev: str, variants: list[tuple[str, str]]) -> None:
    os.makedirs(GPU_DIR, exist_ok=True)
    nvcc(ROOT, NEW)
    nvcc(ROOT, LINEINFO, "-lineinfo")
    nvcc_at(base_rev, BASE)
    for name, rev in variants:
        nvcc_at(rev, variant_binary(name))


def parse_points(spec: str) -> list[tuple[str, ...]]:
    points = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        fields = tuple(f.strip() for f in item.split(","))
        if len(fields) != 6:
            raise SystemExit(f"a point is B,L,H,q_len,iters,dist; got {item!r}")
        points.append(fields)
    return points


# Seconds a harness run may take before it counts as hung (a kernel that waits forever).
POINT_TIMEOUT_S = 120
SUITE_TIMEOUT_S = 300


def harness_rows(binary: str, label: str, point: tuple[str, ...], flags: list[str]) -> list[str]:
    """The harness's timing rows of one point, their variant column renamed to `label`; a failed
    check, or a harness that exits with an error or hangs, gives a FAIL line."""
    b, length, heads, q_len, iters, dist = point
    try:
        result = subprocess.run([binary, "one", "--B", b, "--L", length, "--H", heads, "--q-len",
                                 q_len, "--dist", dist, "--iters", iters, "--ref-requests", "1",
                                 "--variants", "default", *flags],
                                capture_output=True, text=True, timeout=POINT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [f"FAIL {label} {','.join(point)}: no result within {POINT_TIMEOUT_S} s"]
    if result.returncode != 0 and "FAIL" not in result.stdout:
        return [f"FAIL {label} {','.join(point)}: exit {result.returncode} "
                f"{(result.stdout + result.stderr).strip().splitlines()[-1:]}"]
    rows = []
    for line in result.stdout.splitlines():
        if "FAIL" in line:
            rows.append(line)
        elif line.startswith("| ") and line[2:3].isdigit():
            cells = line.split("|")
            cells[6] = f" {label} "
            rows.append("|".join(cells))
    return rows


def logged_run(cmd: list[str], log: str) -> int:
    """Runs cmd with its output in `log`; its exit status, or "timeout" appended to the log and
    124 when it takes longer than SUITE_TIMEOUT_S."""
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=SUITE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            f.write(f"timeout: no result within {SUITE_TIMEOUT_S} s\n")
            return 124


def checks(out_dir: str, flags: list[str]) -> list[str]:
    """The new build's check suites and, on its -lineinfo build, the three sanitizers."""
    summary = []
    for mode in ("check", "check-fp8"):
        log = os.path.join(out_dir, f"sm90-ab-{mode}.log")
        rc = logged_run([NEW, mode, *flags], log)
        summary.append(f"{mode}: rc={rc} {last_line(log)}")
    for tool in ("memcheck", "racecheck", "synccheck"):
        for suite in ("sanitize", "sanitize-fp8"):
            log = os.path.join(out_dir, f"sm90-ab-{suite}-{tool}.log")
            rc = logged_run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "9",
                             LINEINFO, suite, *flags], log)
            found = [line for line in open(log) if "SUMMARY" in line]
            summary.append(f"{suite} {tool}: rc={rc} {found[-1].strip() if found else ''}")
    return summary


def last_line(path: str) -> str:
    lines = [line.strip() for line in open(path) if line.strip()]
    return lines[-1] if lines else ""


def table(lines: list[str]) -> str:
    """Per point (H, B, L, q_len, page): each build's µs per layer in pass order ("base", then
    "new", then the other builds as they first appear) and each build's mean time over base's
    (means, so that a pass a build failed in does not weigh); FAIL rows are counted."""
    times: dict[tuple[str, ...], dict[str, list[float]]] = {}
    labels = ["base", "new"]
    fails = 0
    for line in lines:
        if "FAIL" in line:
            fails += 1
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7 or not cells[0].isdigit() or not cells[5].isidentifier():
            continue  # not a harness row: a check row, a header, a table printed before
        if cells[5] not in labels:
            labels.append(cells[5])
        times.setdefault(tuple(cells[:5]), {}).setdefault(cells[5], []).append(float(cells[6]))
    others = labels[1:]
    header = ["H", "B", "L", "q_len", "page", *(f"{label} µs" for label in labels),
              *(f"{label} / base" for label in others)]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, by_label in times.items():
        base = by_label.get("base", [])
        cells = [*key, *(", ".join(map(str, by_label.get(label, []))) for label in labels)]
        for label in others:
            own = by_label.get(label, [])
            cells.append(f"{(sum(own) / len(own)) / (sum(base) / len(base)):.3f}"
                         if base and own else "-")
        out.append("| " + " | ".join(cells) + " |")
    out.append(f"\n{fails} failed check(s)")
    return "\n".join(out)


def run(points: list[tuple[str, ...]], passes: int, with_checks: bool, flags: list[str],
        variants: list[str]) -> None:
    out_dir = os.environ.get("OUT", ".")
    builds = [(BASE, "base"), (NEW, "new"),
              *((variant_binary(v), v) for v in check_variant_names(variants))]
    missing = [binary for binary, _ in builds if not os.path.exists(binary)]
    if missing:
        raise SystemExit(f"no harness build at {', '.join(missing)}: run `build` first")
    if with_checks:
        print("\n".join(checks(out_dir, flags)), flush=True)
    lines = []
    for number in range(passes):
        # Every other pass in reverse order, so that no build always runs first at a point (a
        # sustained run warms the board, and the next one at the same point pays for it).
        in_order = builds if number % 2 == 0 else builds[::-1]
        for point in points:
            for binary, label in in_order:
                lines += harness_rows(binary, label, point, flags)
    with open(os.path.join(out_dir, "sm90-ab.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(table(lines))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sm90_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build_args = commands.add_parser("build")
    build_args.add_argument("base_rev")
    build_args.add_argument("--variant", action="append", default=[], metavar="NAME=REV")
    run_args = commands.add_parser("run")
    run_args.add_argument("--points", default=DEFAULT_POINTS)
    run_args.add_argument("--passes", type=int, default=2)
    run_args.add_argument("--checks", action="store_true")
    run_args.add_argument("--variants", default="", metavar="NAME,...")
    commands.add_parser("table").add_argument("log")
    commands.add_parser("same-code").add_argument("rev")
    args = parser.parse_args(argv)
    if args.command == "same-code":
        raise SystemExit(same_code(args.rev))
    if args.command == "build":
        build(args.base_rev, parse_variants(args.variant))
    elif args.command == "run":
        run(parse_points(args.points), args.passes, args.checks, flags,
            [v for v in args.variants.split(",") if v])
    else:
        print(table(open(args.log).read().splitlines()))


if __name__ == "__main__":
    main()
