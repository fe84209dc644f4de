"""Result files: one JSON per benchmark run holding ``env``, ``runs`` and one record per point,
merged by point key and rewritten (atomically) after every point; derived fields and the one-line
summary of a record."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from benchmarks.grid import Point

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GPU_TAGS = ("h200", "h100", "b200", "a100")


def record_key(record: dict) -> str:
    return record.get("key") or Point(record["B"], record["L"], record["H"], record["q_len"],
                                      record["page_size"]).key


def record_order(record: dict) -> tuple:
    """The order of records in files and tables: page size, heads, q_len, batch, length."""
    return tuple(record.get(k, 0) for k in ("page_size", "H", "q_len", "B", "L"))


def default_out(env: dict, dry_run: bool) -> str:
    """benchmarks/results/<gpu>-decode.json (cpu-dryrun-decode.json for a dry run)."""
    if dry_run:
        tag = "cpu-dryrun"
    else:
        gpu = (env.get("gpu") or "gpu").lower()
        tag = next((t for t in GPU_TAGS if t in gpu), gpu.split()[-1])
    return os.path.join(RESULTS_DIR, f"{tag}-decode.json")


def load_results(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        data.setdefault("records", [])
        data.setdefault("runs", [])
        return data
    return {"schema": 1, "env": {}, "runs": [], "records": []}


def load_merged(paths: list[str]) -> tuple[dict, list[dict]]:
    """(the last file's env, the records of all files merged by key, later files winning), sorted."""
    env: dict = {}
    records: dict[str, dict] = {}
    for path in paths:
        data = load_results(path)
        env = data.get("env") or env
        for r in data["records"]:
            key = record_key(r)
            records[key] = {**records.get(key, {}), **r}
    return env, sorted(records.values(), key=record_order)


def _json_default(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def save_results(path: str, data: dict, copy_to: str | None = None) -> None:
    data["records"].sort(key=record_order)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    if copy_to:
        os.makedirs(copy_to, exist_ok=True)
        shutil.copyfile(path, os.path.join(copy_to, os.path.basename(path)))


def merge_record(data: dict, record: dict) -> None:
    """Put ``record`` into ``data``: over the record of the same key, whose other fields stay."""
    for old in data["records"]:
        if old.get("key") == record["key"]:
            errors = {**old.get("errors", {}), **record.get("errors", {})}
            for m in record.get("methods_done", []):  # a fresh measurement clears an old error
                if m not in record.get("errors", {}):
                    errors.pop(m, None)
            done = sorted(set(old.get("methods_done", [])) | set(record.get("methods_done", [])))
            old.update(record)
            old["errors"] = errors
            old["methods_done"] = done
            return
    data["records"].append(record)


def name_plan_comparison(record: dict) -> None:
    """The host- vs device-schedule fields under the names the planner's goal uses: µs per layer of
    the decode run with either schedule, from steps of N layers. The device-planned step also runs
    the planner once, so its share (its graph node's time / N, timed apart) is taken out. Where
    the device-planned step was replayed as a CUDA graph, it is compared with the host-planned step
    replayed the same way (jax_mla_graph_us)."""
    if record.get("plan_us") is None or record.get("jax_mla_device_plan_us") is None:
        return
    layers = record.get("jax_mla_device_plan_layers") or record["layers"]
    host_field = "jax_mla_graph_us" if record.get("jax_mla_device_plan_in_graph") else "jax_mla_us"
    planner = record.get("device_plan_graph_us") or record.get("device_plan_us") or 0.0
    record["run_with_host_plan_us"] = record[host_field]
    record["run_with_device_plan_us"] = record["jax_mla_device_plan_us"] - planner / layers


SUMMARY_FIELDS = (("jax_mla", "jax_mla_us"), ("graph", "jax_mla_graph_us"),
                  ("noplan", "jax_mla_noplan_us"), ("devplan", "jax_mla_device_plan_us"),
                  ("planner", "device_plan_us"), ("planner-node", "device_plan_graph_us"),
                  ("step-host", "step_host_plan_ms"), ("step-dev", "step_device_plan_ms"),
                  ("step-host-unguarded", "step_host_plan_unguarded_ms"),
                  ("step-dev-unguarded", "step_device_plan_unguarded_ms"),
                  ("guard", "guard_us"), ("guard-plan", "guard_plan_us"),
                  ("FI", "flashinfer_torch_us"), ("FI-graph", "flashinfer_graph_us"),
                  ("naive", "xla_naive_us"), ("jax_mla_xla", "jax_mla_xla_us"))


def summary_line(record: dict) -> str:
    """One line per measured point, for the progress output."""
    parts = [f"{name} {record[field]:.1f}{field.rsplit('_', 1)[1]}"
             for name, field in SUMMARY_FIELDS if record.get(field) is not None]
    parts.append(f"floor {record['floor_us']:.1f}us")
    if record.get("jax_mla_us") and record.get("flashinfer_torch_us"):
        parts.append(f"jax/FI {record['jax_mla_us'] / record['flashinfer_torch_us']:.3f}")
    if record.get("skipped"):
        parts.append(f"SKIPPED: {record['skipped']}")
    if record.get("errors"):
        parts.append(f"errors: {', '.join(sorted(record['errors']))}")
    return "  ".join(parts)
