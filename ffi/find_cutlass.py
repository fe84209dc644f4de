"""Print the CUTLASS include directory (the folder holding cute/ and cutlass/) for the sm90
handler: the nvidia-cutlass package's, else flashinfer-python's copy; nothing when neither is
installed. The packages are located with importlib.util.find_spec, without importing them.

Used by ffi/CMakeLists.txt (when CUTLASS_INCLUDE_DIR is not set), and through
configured_cutlass_include by the host tests that compile sm90 code
(tests/test_sm90_launch_options.py) and by benchmarks/sm90_ab.py.
"""

from __future__ import annotations

import importlib.util
import os

PACKAGE_COPIES = (("cutlass_library", ("source", "include")),
                  ("flashinfer", ("data", "cutlass", "include")))


def is_cutlass_include(path: str) -> bool:
    """Whether ``path`` holds the CUTLASS/CuTe headers the sm90 code includes."""
    return os.path.isfile(os.path.join(path, "cute", "arch", "mma_sm90_gmma.hpp"))


def cutlass_include() -> str | None:
    """The first installed package copy of the CUTLASS headers, or None."""
    for package, parts in PACKAGE_COPIES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            path = os.path.join(root, *parts)
            if is_cutlass_include(path):
                return path
    return None


def configured_cutlass_include() -> str | None:
    """The headers a build of the sm90 code takes, looked up as ffi/CMakeLists.txt does:
    CUTLASS_INCLUDE_DIR from the environment when it holds them, else cutlass_include()."""
    override = os.environ.get("CUTLASS_INCLUDE_DIR", "")
    return override if override and is_cutlass_include(override) else cutlass_include()


if __name__ == "__main__":
    found = cutlass_include()
    if found:
        print(found)
