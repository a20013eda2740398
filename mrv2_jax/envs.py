"""Every environment variable the project reads, in one registry, and the only module that
touches `os.environ`.

Each switch has a type, a default, its allowed values and one line of documentation; `read`
parses and validates it, and `render_markdown` writes the table that docs/switches.md holds.
Kernel choices are read once, when an engine's configuration is built (config.KernelConfig),
never while a step is traced.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

BOOL_VALUES = ("0", "1")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str  # "choice" (one of `allowed`), "bool" ("0" / "1"), "int" (> 0), "index" (>= 0), "str" or "path"
    default: str | bool | None
    doc: str
    allowed: tuple[str, ...] = ()

    def parse(self, raw: str):
        """The value of `raw` (the variable's text), or ValueError naming the variable."""
        if self.kind == "choice":
            if raw not in self.allowed:
                raise ValueError(f"{self.name} must be one of {', '.join(self.allowed)}; got {raw!r}")
            return raw
        if self.kind == "bool":
            if raw not in BOOL_VALUES:
                raise ValueError(f"{self.name} must be one of {', '.join(BOOL_VALUES)}; got {raw!r}")
            return raw == "1"
        if self.kind == "int":
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"{self.name} must be a positive integer; got {raw!r}")
            return int(raw)
        if self.kind == "index":
            if not raw.isdigit():
                raise ValueError(f"{self.name} must be an integer >= 0; got {raw!r}")
            return int(raw)
        if self.kind == "path":
            return os.path.expanduser(raw)
        return raw


def _choice(name, default, allowed, doc):
    return Switch(name, "choice", default, doc, tuple(allowed))


SAMPLER_PASS_MODES = ("auto", "kernel", "interpret", "reference")  # the three MRV2_SAMPLER_* switches

SWITCHES: dict[str, Switch] = {s.name: s for s in (
    _choice("MRV2_RUNNER", "v2", ("v1", "v2"), "Model runner when `--runner` is not given."),
    Switch("MRV2_COMPILATION_CACHE", "path", "~/.cache/mrv2_jax/xla",
           "Directory of the persistent XLA compilation cache; `off` turns it off."),
    Switch("MRV2_CHECKPOINTS", "path", None,
           "Directory searched for model names (default: `checkpoints/` in the repository)."),
    Switch("MRV2_STRICT_COMPILES", "bool", False,
           "`1`: an XLA compile inside an engine step after warm-up is an error, not a warning (tests)."),
    Switch("MRV2_DEFAULT_XLA_FLAGS", "bool", True,
           "`0`: leave out the performance XLA flags, step compile options and one-GPU allocator (the "
           "correctness flag stays; xla_flags.py)."),
    Switch("MRV2_API_KEY", "str", None, "API key the server requires when `--api-key` is not given."),
    _choice("MRV2_SAMPLER_KERNELS", "auto", SAMPLER_PASS_MODES,
            "Default of KernelConfig.sampler_logit_stats: the sampler's pass over the logits and rank count."),
    _choice("MRV2_SAMPLER_NOISE_PASS", "auto", SAMPLER_PASS_MODES,
            "Default of KernelConfig.sampler_noise_pass: the sampler's whole-row noise pass."),
    _choice("MRV2_SAMPLER_SLOW_PATH", "auto", SAMPLER_PASS_MODES,
            "Default of KernelConfig.sampler_slow_path: the sampler's whole-row threshold search."),
    _choice("MRV2_MOE_BACKEND", "auto", ("auto", "pallas", "mgpu", "ragged_dot", "dense"),
            "Default of KernelConfig.moe_backend: the grouped GEMM of the MoE experts."),
    Switch("MRV2_STRUCTURED_STATES", "int", "2048",
           "States of the device's structured-output automaton pool (8 * ceil(V / 32) bytes each)."),
    Switch("MRV2_STRUCTURED_EXCEPTIONS", "int", "262144",
           "Exception entries (4 bytes each) of the device's structured-output automaton pool."),
    Switch("MRV2_NUM_PROCESSES", "int", None,
           "Processes of a multi-host run when `--num-processes` is not given (docs/parallelism.md, Several hosts)."),
    Switch("MRV2_COORDINATOR_ADDRESS", "str", None,
           "`host:port` of process 0 when `--coordinator-address` is not given (multi-host runs)."),
    Switch("MRV2_PROCESS_ID", "index", None,
           "This process's rank, 0 .. processes - 1, when `--process-id` is not given (multi-host runs)."),
    Switch("MRV2_GIT_SHA", "str", None, "Benchmarks: the commit recorded in their reports (default: `git rev-parse`)."),
    Switch("MRV2_VLLM_SITE", "path", None,
           "Benchmarks: a folder put first on vLLM's PYTHONPATH (`bench compare --vllm-site`)."),
    Switch("MRV2_VLLM_MODEL", "path", "/tmp/qwen3-0.6b",
           "Benchmarks: the Qwen3-0.6B directory vLLM loads (`bench compare --vllm-model`)."),
)}


def read(name: str):
    """The parsed value of registered variable `name`, or its default when it is unset or empty."""
    switch = SWITCHES[name]
    raw = os.environ.get(name, "")
    if raw == "":
        return switch.parse(switch.default) if isinstance(switch.default, str) else switch.default
    return switch.parse(raw)


def read_external(name: str) -> str:
    """A variable that another program owns (PYTHONPATH, XLA_FLAGS, vLLM's), as text ("": unset);
    not a switch of this project, so not in the registry."""
    if name in SWITCHES:
        raise ValueError(f"{name} is a registered switch: use envs.read")
    return os.environ.get(name, "")


def get_xla_flags() -> str:
    """XLA_FLAGS (XLA's own variable, read by the backend when it starts)."""
    return read_external("XLA_FLAGS")


def set_xla_flags(flags: str) -> None:
    os.environ["XLA_FLAGS"] = flags


def get_xla_allocator() -> str:
    """XLA_PYTHON_CLIENT_ALLOCATOR (JAX's GPU memory allocator, read when the backend starts; "": not
    chosen, JAX's default pool unless an engine on one GPU sets it, xla_flags.py)."""
    return read_external("XLA_PYTHON_CLIENT_ALLOCATOR").lower()


def set_xla_allocator(allocator: str) -> None:
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = allocator


def get_xla_memory_fraction() -> float:
    """XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's): the share of a GPU's memory JAX's allocator may hold,
    0.75 where unset, as in JAX."""
    text = read_external("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        fraction = float(text) if text else 0.75
    except ValueError:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not in (0, 1]")
    return fraction


def prometheus_multiproc_dir() -> str:
    """PROMETHEUS_MULTIPROC_DIR (prometheus-client's own variable): where the API server processes
    of one server keep their request metrics, so that each /metrics adds up all of them; "" when
    the server has one API process."""
    return read_external("PROMETHEUS_MULTIPROC_DIR")


def set_prometheus_multiproc_dir(path: str) -> None:
    """Set it for this process and the processes it starts; before prometheus_client is imported,
    which reads it once."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def subprocess_env(**extra: str) -> dict[str, str]:
    """A copy of this process's environment with `extra` added, for a child process."""
    return {**os.environ, **extra}


@contextlib.contextmanager
def child_environment(**values: str):
    """Set `values` in this process's environment for the duration of the block, for processes
    started inside it that copy it (multiprocessing's spawn takes no environment argument)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def render_markdown() -> str:
    """The registry as a markdown table (docs/switches.md holds this text)."""
    lines = ["| variable | type | default | allowed values | what it does |", "|---|---|---|---|---|"]
    for s in SWITCHES.values():
        default = {True: "`1`", False: "`0`", None: "unset"}.get(s.default, f"`{s.default}`")
        allowed = ", ".join(f"`{v}`" for v in (s.allowed or (BOOL_VALUES if s.kind == "bool" else ())))
        lines.append(f"| `{s.name}` | {s.kind} | {default} | {allowed or 'any'} | {s.doc} |")
    return "\n".join(lines) + "\n"
