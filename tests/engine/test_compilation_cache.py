"""The engine's set-up of JAX's persistent compilation cache (engine/compilation_cache.py): on GPUs the
folder is pruned once, oldest entries first, and JAX's own size limit (a folder scan under a file lock
at every write) stays off; on CPUs JAX's limit is on."""

import os

import jax
import pytest

from mrv2_jax.engine import compilation_cache
from tests.conftest import jax_cache_settings

SETTINGS = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size",
            "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")


def make_entry(folder, key: str, size: int, written_s: int, read_s: int | None = None) -> None:
    """A cache entry as JAX names it, written at `written_s`, with JAX's record of a read at `read_s`."""
    path = folder / f"{key}-cache"
    path.write_bytes(b"x" * size)
    os.utime(path, (written_s, written_s))
    if read_s is not None:
        (folder / f"{key}-atime").write_bytes((read_s * 10**9).to_bytes(8, "little"))


def test_prune_deletes_the_oldest_entries_until_the_rest_fit(tmp_path):
    # key: (size, written, read or None); "c" is the oldest written but was read last.
    entries = {"a": (300, 1_000, None), "b": (200, 2_000, 2_500), "c": (400, 500, 9_000), "d": (100, 3_000, None),
               "e": (250, 4_000, None)}
    for key, (size, written, read) in entries.items():
        make_entry(tmp_path, key, size, written, read)
    (tmp_path / ".lockfile").write_bytes(b"")
    (tmp_path / "xla_gpu_kernel_cache").mkdir()
    limit = 700

    # Reference: a plain loop over the entries by their last use, dropping until the rest fit.
    by_use = sorted(entries, key=lambda k: max(entries[k][1], entries[k][2] or 0))
    kept, total = set(entries), sum(size for size, _, _ in entries.values())
    for key in by_use:
        if total <= limit:
            break
        kept.discard(key)
        total -= entries[key][0]

    assert compilation_cache.prune(tmp_path, limit) == len(entries) - len(kept)
    assert kept == {"c", "e"}  # the loop's answer, spelled out: 650 bytes
    assert {p.name for p in tmp_path.glob("*-cache")} == {f"{k}-cache" for k in kept}
    assert {p.name for p in tmp_path.glob("*-atime")} == {"c-atime"}  # "b"'s went with it
    assert (tmp_path / ".lockfile").exists() and (tmp_path / "xla_gpu_kernel_cache").is_dir()
    assert compilation_cache.prune(tmp_path, limit) == 0  # already fits


@pytest.mark.parametrize("backend", ["gpu", "cpu"], ids=["gpu-backend", "cpu-backend"])  # ("gpu" alone: the marker)
def test_enable_prunes_on_gpus_and_uses_jaxs_limit_on_cpus(tmp_path, monkeypatch, backend):
    folder = tmp_path / "xla"
    folder.mkdir()
    for i in range(4):
        make_entry(folder, f"k{i}", 100, 1_000 + i)
    monkeypatch.setenv("MRV2_COMPILATION_CACHE", str(folder))
    monkeypatch.setattr(compilation_cache, "MAX_BYTES", 250)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    with jax_cache_settings(**{name: getattr(jax.config, name) for name in SETTINGS}):
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_compilation_cache_max_size", 123)  # as an earlier engine's setting could leave it
        compilation_cache.enable()
        assert jax.config.jax_compilation_cache_dir == str(folder)
        if backend == "gpu":
            assert jax.config.jax_compilation_cache_max_size == -1  # no scan under a lock at every write
            assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
            assert sorted(p.name for p in folder.glob("*-cache")) == ["k2-cache", "k3-cache"]
        else:
            assert jax.config.jax_compilation_cache_max_size == 250
            assert len(list(folder.glob("*-cache"))) == 4  # JAX's limit prunes at its next write


def test_enable_leaves_a_cache_folder_the_user_gave_jax(tmp_path, monkeypatch):
    monkeypatch.setenv("MRV2_COMPILATION_CACHE", str(tmp_path / "ours"))
    with jax_cache_settings(**{name: getattr(jax.config, name) for name in SETTINGS}):
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
        compilation_cache.enable()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
        assert not (tmp_path / "ours").exists()
