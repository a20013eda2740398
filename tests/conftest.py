"""Shared test setup: CPU by default; `-m gpu` tests need a GPU, `-m oracle` tests need torch."""

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from mrv2_jax.xla_flags import prefer_vmm_allocator

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The suite starts dozens of Python processes (the xdist workers, engine and API processes, servers, CLI
# runs, notebook kernels), each importing jax, flax and the engine. Where PYTHONDONTWRITEBYTECODE is set
# (some machine images set it) none of them keeps the bytecode it compiles, so every process compiles
# each module it imports from source again; the suite's processes write it and reuse it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
os.environ.setdefault("MRV2_STRICT_COMPILES", "1")  # any compile inside an engine step fails
# XLA:CPU compiles the engine's step programs about twice as fast without LLVM's optimisations, and
# compiling is most of the suite's time; tests check what programs compute, not how fast they run.
# Set before JAX starts its backend; subprocesses (CLI, server, notebooks) inherit it.
CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAGS}".strip()
# A GPU run tests engines on the allocator a one-GPU engine asks for (xla_flags.py): collecting the tests
# starts JAX's backend before any engine is built.
prefer_vmm_allocator(1)

# The suite's compiled programs go to a cache inside the checkout, not the user's (~/.cache/mrv2_jax/xla):
# a fresh clone starts with an empty cache, so `make test` there (and CI) takes the time the suite's
# goal counts, and a rerun in the same checkout reuses what the last run compiled. Child processes
# (servers, CLI, notebooks) inherit it.
os.environ.setdefault("MRV2_COMPILATION_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "xla"))

FIXTURES = Path(__file__).parent / "fixtures"

# The GPU machine lacks the server, notebook and structured-output packages: `pytest -m gpu` must
# still collect. CI installs every extra, so there these modules all run.
_NEEDS = {"fastapi": ["test_async_llm.py", "bench/test_bench_serve.py", "entrypoints/test_openai_protocol.py",
                      "entrypoints/test_openai_server.py", "entrypoints/test_serve_cli.py",
                      "entrypoints/test_server_bad_input.py", "entrypoints/test_engine_process.py",
                      "entrypoints/test_api_servers.py", "entrypoints/test_data_parallel.py"],
          "nbclient": ["test_notebooks.py"], "outlines_core": ["structured/test_automaton.py"],
          "msgspec": ["structured/test_params.py"], "jsonschema": ["engine/test_structured_engine.py"],
          "llguidance": ["structured/test_grammar.py", "engine/test_grammar_engine.py"],
          # tests/server_harness.py imports the engine-process client (pyzmq), which these modules share.
          "zmq": ["entrypoints/test_stream_in_call.py", "runner/test_lazy_programs.py"]}
collect_ignore = [name for module, names in _NEEDS.items() if importlib.util.find_spec(module) is None
                  for name in names]


def pytest_collection_modifyitems(config, items):
    import jax

    on_gpu = jax.default_backend() == "gpu"
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU (run on the accelerator machine)"))


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


# Tests are handed to the xdist workers a module at a time (pytest-xdist's `loadfile`), so that a
# module-scoped fixture (a compiled engine, a live server) is built once, not once per worker; and
# the modules of a group in ONE_WORKER_GROUPS form a single unit: the server modules each build a
# model + a live server, and one after the other on one worker every build after the first loads
# its compiled steps from the persistent compilation cache; the tensor-, pipeline- and
# expert-parallel modules read one child process's runs (tests/parity.py parallel_child), made once
# on their worker. (The `xdist_group` marker would say this, but pytest-xdist 3.8's loadgroup does
# not work with pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads. So the grouping
# is done here, by file name.)
ONE_WORKER_GROUPS = {"test_openai_server.py": "server", "test_server_bad_input.py": "server",
                     "test_serve_cli.py": "server", "test_engine_process.py": "server",
                     "test_tensor_parallel.py": "parallel", "test_pipeline_parallel.py": "parallel",
                     "test_expert_parallel.py": "parallel"}
# The speculative-decoding modules go first, one to each worker, so that they run in fresh worker
# processes: XLA:CPU (jax 0.11.2) aborted compiling their steps in workers that had run much of the
# suite before, never in fresh ones. Each is one unit, so its engines (functools.cache in the
# module, the reference engine included) are built once.
SPEC_FIRST = ("test_spec_decode.py", "test_spec_decode_mtp.py")
# Then the units that take longest (measured, a fresh compilation cache), longest first, so that the
# two workers finish together; test_bench.py a few units after test_engine.py, whose engine shape it
# shares, so that it loads those steps from the persistent cache rather than compiling them beside it.
# Units not named here follow in xdist's order.
LONGEST_FIRST = ("group:server", "test_engine.py", "test_benchmarks.py", "test_moe.py", "group:parallel",
                 "test_bench.py", "test_api_servers.py", "test_lazy_programs.py", "test_notebooks.py",
                 "test_data_parallel.py", "test_sampler.py", "test_sampling_engine.py",
                 "test_structured_engine.py", "test_ragged_paged_attention.py", "test_prompt_logprobs.py",
                 "test_fp8.py", "test_multihost.py", "test_bench_compare.py", "test_bench_serve.py",
                 "test_fused_decode.py", "test_runner_v2.py", "test_stream_in_call.py", "test_paged_model.py",
                 "test_bench_xla_vs_cudagraph.py", "test_logit_stats.py", "test_threshold_search.py", "test_cli.py")


def _unit_name(scope: str) -> str:
    return scope if scope.startswith("group:") else scope.rsplit("/", 1)[-1]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent when xdist is not loaded
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":  # an explicit --dist choice wins
        return None
    from xdist.scheduler import LoadScopeScheduling

    rank = {name: i for i, name in enumerate(SPEC_FIRST + LONGEST_FIRST)}

    class LoadWithGroups(LoadScopeScheduling):
        """Each module one unit, the modules of a group in ONE_WORKER_GROUPS one unit; SPEC_FIRST's
        units first, then LONGEST_FIRST's."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.partition("::")[0]
            group = ONE_WORKER_GROUPS.get(module.rsplit("/", 1)[-1])
            return f"group:{group}" if group else module

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=lambda scope: rank.get(_unit_name(scope), len(rank)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return LoadWithGroups(config, log)


@contextlib.contextmanager
def jax_cache_settings(**settings):
    """JAX's persistent-cache options (`jax_*` config names) set to `settings` inside the block, the
    previous values after it. They are process-wide, and whether the cache is used is memoised per
    process, so the cache is reset on the way in and out."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = {name: getattr(jax.config, name) for name in settings}
    compilation_cache.reset_cache()
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield
    finally:
        compilation_cache.reset_cache()
        for name, value in before.items():
            jax.config.update(name, value)


@pytest.fixture(scope="module")
def no_persistent_compile_cache():
    """Compile without the on-disk cache for one module. XLA:CPU (jax 0.11.2) segfaults now and
    then serialising or deserialising the speculative-decoding modules' executables for the cache
    (`put_executable_and_time` / `get_executable_and_time`: four times in two sessions, always in
    these modules, never when run alone), so they neither write nor read it."""
    with jax_cache_settings(jax_enable_compilation_cache=False):
        yield


@pytest.fixture
def fresh_jax_cache(tmp_path):
    """JAX's persistent compilation cache in an empty folder, keeping every program, for one test."""
    with jax_cache_settings(jax_compilation_cache_dir=str(tmp_path / "jax"),
                            jax_persistent_cache_min_compile_time_secs=0.0,
                            jax_persistent_cache_min_entry_size_bytes=-1):
        yield tmp_path / "jax"
