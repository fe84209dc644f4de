"""Print the CUTLASS include directory (the folder holding cute/ and cutlass/) for the sm90
handler: the nvidia-cutlass package's, else flashinfer-python's copy; nothing when neither is
installed. The packages are located with importlib.util.find_spec, without importing them.

Used by ffi/CMakeLists.txt (when CUTLASS_INCLUDE_DIR is not set) and by the host tests that
compile sm90 code (tests/test_sm90_launch_options.py).
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


if __name__ == "__main__":
    found = cutlass_include()
    if found:
        print(found)
