"""What every benchmark result records about where it ran."""

import datetime
import os
import subprocess

import jax


def describe_environment() -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = os.environ.get("MRV2_GIT_SHA", "unknown")  # set by scripts/gpu_check.sh callers
    device = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_sha": sha, "jax_version": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(device, "device_kind", str(device))}
