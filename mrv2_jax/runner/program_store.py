"""Compiled step programs kept on disk under a key of what they are built from, so that a warm start
loads them without tracing.

JAX's persistent compilation cache is keyed by the lowered program: a warm start still traces and
lowers every step program before it can look one up, and for a model whose layers are unrolled in
dozens of programs that tracing is most of an eager start (docs/benchmarks.md, "Time to a first
token: background compile, and every program at start-up"). `ProgramStore` keys a program by what
determines it instead: a `fingerprint` of the source of this package and of pallas_kernels, the
versions of jax, jaxlib and flax, the devices, the environment's switches and XLA_FLAGS, and the
engine's own inputs (its configuration, the model's config, the KV cache size: `engine/builder.py`),
plus the program's name within the runner. Programs travel as jax.experimental.serialize_executable
payloads; a loaded program checks its arguments' tree on every call, so a stale entry fails loudly.

On the CPU, a program that JAX took from its own persistent compilation cache is not saved: XLA:CPU
(jax 0.11.2) serialises such an executable without its kernels ("Function ... not found" when the
loaded copy runs). `ProgramStore.compile` tells the two apart by JAX's cache-hit event, recorded on
the compiling thread. On GPUs it is saved like a fresh one: otherwise a program that an engine of
another configuration (another store key, the same program) compiled first would come from JAX's
cache, and be traced again, at every start.

A stored program may call Mosaic GPU kernels. Their custom call finds its runtime library through an
environment variable that importing `jax.experimental.mosaic.gpu` sets, which tracing such a kernel
does and loading a stored program does not: `ProgramStore.load` imports it first on a GPU.

Each fingerprint is a folder; the least recently used folders beyond `MAX_FINGERPRINTS` are removed
when a new one is made. Files are written to a temporary name and renamed, so processes sharing the
folder never read half a program.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

MAX_FINGERPRINTS = 8  # fingerprint folders kept (each one engine configuration's programs)
_PACKAGES = ("mrv2_jax", "pallas_kernels")
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_this_thread = threading.local()  # .cache_hits: JAX's persistent-cache hits on this thread
# Backends that serialise an executable loaded from JAX's cache without its kernels (see above).
_RESERIALISES_WITHOUT_KERNELS = ("cpu",)


def _count_cache_hits(event: str, **_) -> None:
    if event == _CACHE_HIT_EVENT:
        _this_thread.cache_hits = getattr(_this_thread, "cache_hits", 0) + 1


jax.monitoring.register_event_listener(_count_cache_hits)


@functools.cache
def _prepare_kernel_runtimes() -> None:
    """Make the Mosaic GPU runtime findable by the programs about to be loaded (see the module's doc)."""
    if jax.default_backend() == "gpu":
        importlib.import_module("jax.experimental.mosaic.gpu")


def source_digest(roots: Iterable[Path]) -> str:
    """sha256 over every .py file under `roots` (relative path and bytes, in sorted order)."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def package_roots() -> list[Path]:
    """The folders of the packages whose source builds the step programs, where they were imported
    from (one may come from another tree on the path than the other, as in a same-machine A/B)."""
    return [Path(importlib.import_module(name).__file__).resolve().parent for name in _PACKAGES]


def environment_key() -> dict:
    """What outside the engine's configuration changes a compiled program: versions, devices,
    the environment's switches and XLA_FLAGS."""
    import flax
    import jaxlib

    from mrv2_jax import envs

    devices = jax.devices()
    return {"source": source_digest(package_roots()), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "flax": flax.__version__, "backend": jax.default_backend(),
            "devices": [d.device_kind for d in devices], "xla_flags": envs.get_xla_flags(),
            "switches": {name: repr(envs.read(name)) for name in sorted(envs.SWITCHES)}}


def fingerprint(*parts) -> str:
    """sha256 of the environment key and `parts` (each given by its repr)."""
    text = repr((sorted(environment_key().items()), *parts))
    return hashlib.sha256(text.encode()).hexdigest()


class ProgramStore:
    """Compiled programs of one engine configuration (`fingerprint`) under `root`."""

    def __init__(self, root: str | Path, fingerprint: str, max_fingerprints: int = MAX_FINGERPRINTS):
        self.folder = Path(root) / fingerprint[:32]
        self.loaded = 0  # programs this store has handed out from disk
        self.not_saved = 0  # programs compiled through JAX's persistent cache, so not kept (see above)
        new = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        os.utime(self.folder)  # most recently used
        if new:
            self._evict(Path(root), max_fingerprints)

    def _file(self, name: str) -> Path:
        return self.folder / (hashlib.sha256(name.encode()).hexdigest()[:32] + ".xla")

    def load(self, name: str):
        """The program saved as `name`, loaded on the default backend, or None."""
        path = self._file(name)
        _prepare_kernel_runtimes()
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged or foreign file: compile again and replace it
            log.warning("program store: could not load %s (%s: %s); compiling it", name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return program

    def compile(self, name: str, lowered, compiler_options: dict | None = None):
        """Compile `lowered` (a jax Lowered) and keep it as `name`, unless JAX's persistent cache gave it
        on a backend that cannot serialise such a program whole."""
        before = getattr(_this_thread, "cache_hits", 0)
        compiled = lowered.compile(compiler_options or None)
        if getattr(_this_thread, "cache_hits", 0) != before and jax.default_backend() in _RESERIALISES_WITHOUT_KERNELS:
            self.not_saved += 1
            log.info("program store: %s came from JAX's compilation cache; not saved", name)
        else:
            self.save(name, compiled)
        return compiled

    def save(self, name: str, compiled) -> None:
        """Keep `compiled` (a jax Compiled) as `name`; a failure is logged, never raised."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".tmp", delete=False) as f:
                f.write(blob)
            os.replace(f.name, self._file(name))
        except Exception as e:
            log.warning("program store: could not save %s (%s: %s)", name, type(e).__name__, e)

    @staticmethod
    def _evict(root: Path, keep: int) -> None:
        folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in folders[keep:]:
            shutil.rmtree(old, ignore_errors=True)
