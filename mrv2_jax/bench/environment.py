"""What every benchmark result records about where it ran."""

import datetime
import importlib.metadata
import json
import subprocess
from pathlib import Path

from mrv2_jax import envs


def git_sha() -> str:
    """The commit of the checkout this code runs from (so a tree run through PYTHONPATH beside another
    reports its own), with "+dirty" when its tracked files differ from that commit; "unknown" without git.
    An explicit MRV2_GIT_SHA wins: the GPU machine's copy of the checkout may carry a stale .git (seen:
    results stamped with the session's first commit; the copy then reads as dirty)."""
    if envs.read("MRV2_GIT_SHA"):
        return envs.read("MRV2_GIT_SHA")
    tree = str(Path(__file__).resolve().parents[2])

    def git(*args) -> str:
        return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}+dirty" if dirty else sha


def gpu_name_from_driver() -> str | None:
    """The first GPU's name as nvidia-smi reports it, without starting CUDA in this process."""
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip().splitlines()[0] if run.stdout.strip() else None


def describe_environment(probe_device: bool = True) -> dict:
    """Date, git sha, jax version, backend, device and, on GPUs, allocator. `probe_device=False` is
    for processes that only drive others (a benchmark client, the comparison's orchestrator): asking
    JAX for its devices would start the GPU backend there and take most of the GPU memory from the
    engine under test, so the device name comes from nvidia-smi instead."""
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "git_sha": git_sha()}
    if probe_device:
        import jax

        device = jax.devices()[0]
        env |= {"jax_version": jax.__version__, "backend": jax.default_backend(),
                "device": getattr(device, "device_kind", str(device))}
        # The allocator asked for when the backend started (xla_flags.py; unset: JAX's default pool).
        return env | ({"gpu_allocator": envs.get_xla_allocator() or "default"} if env["backend"] == "gpu" else {})
    gpu = gpu_name_from_driver()
    return env | {"jax_version": importlib.metadata.version("jax"), "backend": "gpu" if gpu else "cpu",
                  "device": gpu or "cpu"}


def write_report(report: dict, path) -> None:
    """Every benchmark's JSON: indented, and anything JSON lacks (a Path, a dtype) as its str."""
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


def flag_probe_report(args, results, output_json: str | None) -> dict:
    """The report of a probe run under some XLA_FLAGS: environment, settings, flags and results;
    written to `output_json` when given."""
    report = {**describe_environment(), "settings": vars(args), "xla_flags": envs.get_xla_flags(),
              "results": results}
    if output_json:
        write_report(report, output_json)
    return report
