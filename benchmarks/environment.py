"""What a run measured on: GPU, driver, CUDA, package versions, the commit."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess

from benchmarks.problem import L2_BYTES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return str(getattr(module, "__version__", "unknown"))


def _dist_version(name: str) -> str | None:
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:  # noqa: BLE001
        return None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def commit_id() -> str | None:
    """``JAX_MLA_COMMIT`` when set (a copy without .git), else git's HEAD, '+dirty' if modified."""
    if os.environ.get("JAX_MLA_COMMIT"):
        return os.environ["JAX_MLA_COMMIT"]
    head = _run(["git", "rev-parse", "HEAD"], cwd=REPO)
    if head and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO):
        head += "+dirty"
    return head


def environment(dry_run: bool, torch_mod) -> dict:
    import jax

    env = {"date": utc_now(), "host": platform.node(), "python": platform.python_version(),
           "jax": jax.__version__, "jaxlib": _dist_version("jaxlib"),
           "jax_cuda_plugin": _dist_version("jax-cuda13-plugin") or _dist_version("jax-cuda12-plugin"),
           "jax_mla": _version("jax_mla"), "commit": commit_id(),
           "jax_platform": jax.default_backend(), "dry_run": dry_run,
           "torch": getattr(torch_mod, "__version__", None) if torch_mod else _dist_version("torch"),
           "flashinfer": _dist_version("flashinfer-python"), "triton": _dist_version("triton"),
           "l2_bytes": L2_BYTES,
           "gpu": None, "driver": None, "cuda": None}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        name, _, driver = smi.splitlines()[0].partition(",")
        env["gpu"], env["driver"] = name.strip(), driver.strip()
        header = _run(["nvidia-smi"]) or ""
        if "CUDA Version:" in header:
            env["cuda_driver_api"] = header.split("CUDA Version:")[1].split()[0]
    device = jax.devices()[0]
    if env["gpu"] is None:
        env["gpu"] = getattr(device, "device_kind", device.platform)
    if torch_mod is not None and getattr(torch_mod.version, "cuda", None):
        env["cuda"] = torch_mod.version.cuda
    elif env.get("cuda_driver_api"):
        env["cuda"] = env["cuda_driver_api"]
    try:
        import jax_mla
        env["jax_mla_backends"] = jax_mla.available_backends()
    except Exception as e:  # noqa: BLE001
        env["jax_mla_backends"] = f"error: {e}"
    return env


def script_args(module: str, doc: str, argv=None, add_arguments=None) -> argparse.Namespace:
    """``python -m module``'s command line: ``--help`` prints ``doc`` (the module docstring) and
    unknown options are refused; ``add_arguments(parser)`` adds the script's own options."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    return parser.parse_args(argv)


def require_cuda_gpu(torch_module=None) -> None:
    """Exit with a message unless a CUDA GPU is here: JAX's backend, or ``torch_module``'s CUDA
    for a script that uses only torch (GPU-only scripts, before their first GPU call)."""
    if torch_module is not None:
        found, what = torch_module.cuda.is_available(), "torch sees no CUDA device"
    else:
        import jax
        found = jax.default_backend() in ("gpu", "cuda")
        what = f"JAX's backend here is {jax.default_backend()!r}"
    if not found:
        raise SystemExit(f"error: this script runs on a CUDA GPU; {what}")
