"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time and
what JAX spent inside it (tracing, lowering, XLA compiles, persistent-cache hits), and a summary
by module.

    python -m pytest -n 2 -p benchmarks.suite_profile --suite-profile-dir /tmp/sp   # one JSON per worker
    python -m benchmarks.suite_profile /tmp/sp/*.json    # the table, largest modules first

JAX reports its compile phases through `jax.monitoring` events, on the thread that compiles, so
a compile running beside a test on a background thread counts for the test running then. Time
spent in child processes (the servers, the multi-device runs) shows only as wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"  # a persistent-cache hit included
CACHE_HIT = "/jax/compilation_cache/cache_hits"
COLUMNS = ("wall", "trace", "lower", "compile", "compiles", "cache_hits")

_current: collections.Counter = collections.Counter()
_records: list[dict] = []


def _on_duration(event: str, duration: float, **_) -> None:
    for column, name in (("trace", TRACE), ("lower", LOWER), ("compile", COMPILE)):
        if event == name:
            _current[column] += duration
            if column == "compile":
                _current["compiles"] += 1


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT:
        _current["cache_hits"] += 1


def pytest_addoption(parser) -> None:
    parser.addoption("--suite-profile-dir", default=".", help="where suite_profile_<worker>.json goes")


def pytest_configure(config) -> None:
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 - pytest's hook signature
    _current.clear()
    _current["start"] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location) -> None:  # noqa: ARG001
    wall = time.perf_counter() - _current.pop("start", time.perf_counter())
    _records.append({"test": nodeid, "wall": wall} | {c: _current[c] for c in COLUMNS[1:]})


def pytest_sessionfinish(session) -> None:
    folder = Path(session.config.getoption("suite_profile_dir"))
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")  # an xdist worker's id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"suite_profile_{worker}.json").write_text(json.dumps(_records))


def by_module(records: list[dict]) -> dict[str, dict]:
    """Sums of every column per test module, and the number of tests."""
    modules: dict[str, dict] = {}
    for record in records:
        totals = modules.setdefault(record["test"].split("::")[0], dict.fromkeys((*COLUMNS, "tests"), 0))
        for column in COLUMNS:
            totals[column] += record[column]
        totals["tests"] += 1
    return modules


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    records = [r for path in args.files for r in json.loads(path.read_text())]
    total = {c: sum(r[c] for r in records) for c in COLUMNS}
    print(f"{len(records)} tests; seconds summed over workers: wall {total['wall']:.0f}, trace {total['trace']:.0f},"
          f" lower {total['lower']:.0f}, XLA compile {total['compile']:.0f} ({total['compiles']} compiles,"
          f" {total['cache_hits']} persistent-cache hits)")
    print(f"{'wall':>7} {'trace':>6} {'lower':>6} {'compile':>7} {'count':>6} {'tests':>5}  module")
    modules = sorted(by_module(records).items(), key=lambda kv: -kv[1]["wall"])
    for name, m in modules[:args.top]:
        print(f"{m['wall']:7.1f} {m['trace']:6.1f} {m['lower']:6.1f} {m['compile']:7.1f} {m['compiles']:6d}"
              f" {m['tests']:5d}  {name}")


if __name__ == "__main__":
    main()
