"""JAX's persistent compilation cache, as the engine sets it up: compiled XLA executables kept on disk
(`MRV2_COMPILATION_CACHE`), so that a second start skips most compiling.

Its size is bounded in two ways, by backend:

- On CPUs JAX's own size limit (`jax_compilation_cache_max_size`). It turns on JAX's file lock around
  every read and write: the suite's pytest workers share the cache, and a process could otherwise read
  an entry another one is still writing (the write is not atomic). XLA:CPU once crashed deserialising
  such an entry. Only programs slower than 0.5 s to compile are kept, so the folder stays small.
- On GPUs every program is kept (so that a warm start compiles nothing: small programs such as the
  dummy-weight initialisers add up), and JAX's size limit would cost a scan of the whole folder
  (a stat and a read per entry) under the lock at every write: at thousands of entries a start's
  compile threads queue on the lock for more than its 10 s timeout and skip their reads and writes
  (docs/benchmarks.md, session 58). So JAX's limit stays off there, and `prune` brings the folder
  under the same size once, when the cache is enabled, oldest entries first. A read of an entry that is
  half written, or pruned meanwhile, fails in decompression; JAX warns and compiles the program.
"""

from pathlib import Path

from mrv2_jax import envs

MAX_BYTES = 8 << 30  # beyond this, the oldest entries go
_ENTRY_SUFFIX = "-cache"  # JAX's names: <key>-cache, and <key>-atime beside it while its size limit is on
_ATIME_SUFFIX = "-atime"


def enable() -> None:
    """Turn the cache on at `MRV2_COMPILATION_CACHE` (`off`: leave it off); a cache folder the user
    already gave JAX wins."""
    import jax

    where = envs.read("MRV2_COMPILATION_CACHE")
    if where.lower() == "off" or jax.config.jax_compilation_cache_dir:
        return
    gpu = jax.default_backend() == "gpu"
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0 if gpu else 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", -1 if gpu else MAX_BYTES)  # -1: JAX's limit off
    if gpu:
        prune(Path(where).expanduser(), MAX_BYTES)


def prune(folder: Path, max_bytes: int) -> int:
    """Delete the oldest entries of a compilation-cache folder (by their last write, or their last read
    where JAX recorded one) until the rest fit `max_bytes` -> how many were deleted. Entries another
    process deletes meanwhile are skipped."""
    entries = []
    for path in folder.glob(f"*{_ENTRY_SUFFIX}"):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        entries.append((max(stat.st_mtime_ns, _recorded_read_ns(path)), stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    deleted = 0
    for _, size, path in sorted(entries, key=lambda entry: entry[0]):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        _atime_path(path).unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted


def _atime_path(entry: Path) -> Path:
    return entry.with_name(entry.name.removesuffix(_ENTRY_SUFFIX) + _ATIME_SUFFIX)


def _recorded_read_ns(entry: Path) -> int:
    """The last read JAX's size limit recorded beside an entry (nanoseconds, little-endian), or 0."""
    try:
        return int.from_bytes(_atime_path(entry).read_bytes(), "little")
    except FileNotFoundError:
        return 0
