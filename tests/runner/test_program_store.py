"""The program store: compiled step programs saved and loaded by a key of what builds them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.runner.program_store import ProgramStore, source_digest
from mrv2_jax.sampling_params import SamplingParams
from tests.engine_reference import greedy_reference
from tests.parity import FIXTURES

MODEL = FIXTURES / "qwen3-tiny"


def double_and_count():
    return jax.jit(lambda x, tree: (x * 2, tree["n"] + 1), donate_argnums=(0,)).lower(
        jnp.ones(4), {"n": jnp.ones(2)}).compile()


def test_a_saved_program_loads_and_runs_as_compiled(tmp_path):
    store = ProgramStore(tmp_path, "a" * 64)
    assert store.load("step/0") is None
    store.save("step/0", double_and_count())
    again = ProgramStore(tmp_path, "a" * 64)
    program = again.load("step/0")
    x = jnp.arange(4.0)
    doubled, counted = program(x, {"n": jnp.zeros(2)})
    np.testing.assert_array_equal(doubled, [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_array_equal(counted, [1.0, 1.0])
    assert x.is_deleted()  # the donation travels with the program
    assert again.loaded == 1
    assert ProgramStore(tmp_path, "b" * 64).load("step/0") is None  # another fingerprint: nothing
    with pytest.raises(TypeError):  # a call with another argument tree fails loudly
        program(jnp.ones(4), [jnp.zeros(2)])


def test_a_program_from_jaxs_cache_is_not_saved_and_a_fresh_one_is(tmp_path, fresh_jax_cache):
    """XLA:CPU re-serialises an executable that JAX loaded from its persistent cache without its
    kernels; the store compiles through JAX's cache but saves only what was compiled afresh (on
    the CPU: GPUs keep both, test_a_gpu_program_from_jaxs_cache_is_saved_and_loads_whole)."""
    def lowered():  # a new lowering each time, so that JAX looks in its persistent cache again
        return jax.jit(lambda x, y: (-jnp.power(x, 3.0) + jnp.tanh(y) @ x, jnp.sin(y))).lower(
            jnp.ones((8, 8)), jnp.ones((8, 8)))

    x, y = jnp.linspace(-1, 1, 64).reshape(8, 8), jnp.linspace(0, 2, 64).reshape(8, 8)
    want = (-np.power(np.asarray(x), 3.0) + np.tanh(np.asarray(y)) @ np.asarray(x), np.sin(np.asarray(y)))
    fresh = ProgramStore(tmp_path / "store", "d" * 64)
    fresh.compile("p", lowered())
    assert fresh.not_saved == 0 and any(fresh_jax_cache.iterdir())
    from_cache = ProgramStore(tmp_path / "store", "e" * 64)
    program = from_cache.compile("p", lowered())
    assert from_cache.not_saved == 1 and from_cache.load("p") is None
    for got in (program(x, y), fresh.load("p")(x, y)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path):
    store = ProgramStore(tmp_path, "c" * 64)
    store.save("p", double_and_count())
    (saved,) = store.folder.glob("*.xla")
    saved.write_bytes(b"not a program")
    assert store.load("p") is None and not saved.exists()


def test_only_the_most_recently_used_fingerprints_are_kept(tmp_path):
    for i in range(4):
        ProgramStore(tmp_path, f"{i}" * 64, max_fingerprints=3)
        os.utime(tmp_path / (f"{i}" * 32), (1000 + i, 1000 + i))
    ProgramStore(tmp_path, "0" * 64, max_fingerprints=3)  # used again: now the newest
    ProgramStore(tmp_path, "9" * 64, max_fingerprints=3)  # a new one evicts the oldest beyond 3
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["0", "3", "9"]


def test_source_digest_follows_every_python_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "notes.txt").write_text("ignored")
    before = source_digest([tmp_path / "pkg"])
    (tmp_path / "pkg" / "notes.txt").write_text("still ignored")
    assert source_digest([tmp_path / "pkg"]) == before
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert source_digest([tmp_path / "pkg"]) != before


def test_a_second_engine_loads_every_program_and_gives_the_same_tokens(tmp_path, monkeypatch, fresh_jax_cache):
    """Eager: the first engine compiles and saves its 2 programs (one bucket x greedy, all), the
    second loads both; a lazy engine of the same configuration finds them too; a background one
    loads both before its first step (warm_up runs both), and with one missing from the store loads
    the other and takes that one from JAX's persistent cache, which the store does not keep (the
    first engine's compile left it there); greedy tokens equal a plain loop's."""
    monkeypatch.setenv("MRV2_COMPILATION_CACHE", str(tmp_path))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 96, n)] for n in (5, 11, 3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    config = dict(dtype="float32", runner="v2", max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                  num_gpu_blocks=64, block_size=4, show_progress=False, max_fused_steps=1,
                  sampler_variants="greedy,all", program_store=True)
    first = LLM(str(MODEL), compile_mode="eager", **config)
    assert first.engine.runner.program_store.loaded == 0
    want = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    assert want == [greedy_reference(MODEL, p, 6) for p in prompts]

    second = LLM(str(MODEL), compile_mode="eager", **config)
    assert second.engine.runner.program_store.loaded == 2 and second.engine.startup.from_program_store == 2
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)] == want
    lazy = LLM(str(MODEL), compile_mode="lazy", **config)
    assert [o.outputs[0].token_ids for o in lazy.generate(prompts, params, use_tqdm=False)] == want
    assert lazy.engine.runner.program_store.loaded >= 1

    background = LLM(str(MODEL), compile_mode="background", **config)
    runner = background.engine.runner
    assert runner.program_store.loaded == 2
    assert all(programs.num_compiled == 2 for _, programs in runner._step_programs.values())
    ran, call_step = [], runner.call_step
    runner.call_step = lambda compiled, packed: ran.append(compiled) or call_step(compiled, packed)
    runner.warm_up()
    assert len(ran) == 2 and background.wait_for_compiles(60)
    assert [o.outputs[0].token_ids for o in background.generate(prompts, params, use_tqdm=False)] == want
    background.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="requests are running"):
        background.wait_for_compiles()
    next(runner.program_store.folder.glob("*.xla")).unlink()
    partial = LLM(str(MODEL), compile_mode="background", **config)
    assert partial.engine.runner.program_store.loaded == 1 and partial.wait_for_compiles(600)
    assert partial.engine.runner.program_store.not_saved == 1
    assert all(programs.num_compiled == 2 for _, programs in partial.engine.runner._step_programs.values())
    assert [o.outputs[0].token_ids for o in partial.generate(prompts, params, use_tqdm=False)] == want
    other = LLM(str(MODEL), compile_mode="eager", **(config | {"max_num_seqs": 2}))  # another key
    assert other.engine.runner.program_store.loaded == 0


# Two fresh processes: the first compiles a Mosaic GPU kernel's program (the KV write) into the store,
# the second only loads it (nothing there traces a kernel) and prints its caches' distance from jnp's.
_MGPU_PROGRAM = """
import sys
import jax, jax.numpy as jnp, numpy as np
from mrv2_jax.runner.program_store import ProgramStore
from pallas_kernels.kv_write import write_kv_reference
root, mode = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
caches = [jnp.zeros((2, 4, 2, 16, 64), jnp.bfloat16) for _ in range(2)]
new = [jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.bfloat16) for _ in range(2)]
slots = jnp.asarray([5, -1, 17], jnp.int32)
store = ProgramStore(root, "f" * 64)
if mode == "save":
    from pallas_kernels.kv_write_mgpu import write_kv_mgpu
    store.compile("kv", jax.jit(lambda k, v, kn, vn, s: write_kv_mgpu(k, v, kn, vn, s, 1)).lower(*caches, *new, slots))
else:
    program = store.load("kv")
    assert program is not None, "the stored program did not load"
    got, want = program(*caches, *new, slots), write_kv_reference(*caches, *new, slots, 1)
    print(max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(got, want)))
"""


@pytest.mark.gpu
def test_a_stored_mosaic_gpu_program_loads_in_a_fresh_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "MRV2_COMPILATION"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    runs = [subprocess.run([sys.executable, "-c", _MGPU_PROGRAM, str(tmp_path), mode], capture_output=True,
                           text=True, env=env, timeout=300) for mode in ("save", "load")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert "could not load" not in runs[1].stderr
    assert float(runs[1].stdout.split()[-1]) == 0.0  # a copy: exact


# Three fresh processes sharing one JAX persistent cache: "fresh" compiles a program (a cuBLAS GEMM
# and a Mosaic GPU kernel) under one store key, "cached" compiles it again under another key, where it
# comes from JAX's cache, and "load" only loads both copies and prints the second's distance from the
# first's results and from jnp's.
_CACHE_HIT_PROGRAM = """
import sys
import jax, jax.numpy as jnp, numpy as np
from mrv2_jax.runner.program_store import ProgramStore
from pallas_kernels.kv_write import write_kv_reference
root, mode = sys.argv[1], sys.argv[2]
jax.config.update("jax_compilation_cache_dir", root + "/jax")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
rng = np.random.default_rng(0)
caches = [jnp.zeros((2, 4, 2, 16, 64), jnp.bfloat16) for _ in range(2)]
new = [jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.bfloat16) for _ in range(2)]
slots = jnp.asarray([5, -1, 17], jnp.int32)
w = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
def step(k, v, kn, vn, s, w):
    from pallas_kernels.kv_write_mgpu import write_kv_mgpu
    return write_kv_mgpu(k, v, kn @ w, vn, s, 1)
store = ProgramStore(root + "/store", ("a" if mode == "fresh" else "b") * 64)
if mode != "load":
    store.compile("p", jax.jit(step).lower(*caches, *new, slots, w))
    print("not_saved", store.not_saved)
else:
    programs = [ProgramStore(root + "/store", key * 64).load("p") for key in "ab"]
    assert None not in programs, "a program was not saved"
    fresh, cached = (program(*caches, *new, slots, w) for program in programs)
    want = write_kv_reference(*caches, new[0] @ w, new[1], slots, 1)
    distance = lambda xs, ys: max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                                  for x, y in zip(xs, ys))
    print(distance(cached, fresh), distance(cached, want))
"""


@pytest.mark.gpu
def test_a_gpu_program_from_jaxs_cache_is_saved_and_loads_whole(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "MRV2_COMPILATION"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    runs = [subprocess.run([sys.executable, "-c", _CACHE_HIT_PROGRAM, str(tmp_path), mode], capture_output=True,
                           text=True, env=env, timeout=300) for mode in ("fresh", "cached", "load")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert runs[1].stdout.split()[-1] == "0"  # saved although JAX's cache gave it
    assert "came from JAX's compilation cache" not in runs[1].stderr
    from_fresh, from_reference = map(float, runs[2].stdout.split()[-2:])
    assert from_fresh == 0.0  # the same executable
    assert from_reference <= 0.25  # bf16 values of magnitude ~8 (a GEMM of 64 standard normals): ~2 roundings


def test_the_source_key_reads_the_kernels_actually_imported(tmp_path):
    """A pallas_kernels imported from another tree on the path (a same-machine A/B) keys programs by its
    own source, not by the copy beside mrv2_jax: an edit there changes the key."""
    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "pallas_kernels", tmp_path / "pallas_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    script = ("from mrv2_jax.runner.program_store import package_roots, source_digest; "
              "print(package_roots()[1]); print(source_digest(package_roots()))")

    def key():
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"}
        lines = subprocess.run([sys.executable, "-P", "-c", script], env=env, cwd=tmp_path, check=True,
                               capture_output=True, text=True).stdout.split()
        return Path(lines[0]), lines[1]

    where, before = key()
    assert where == (tmp_path / "pallas_kernels").resolve()
    with open(tmp_path / "pallas_kernels" / "kv_write_mgpu.py", "a") as f:
        f.write("\n# an edit\n")
    assert key()[1] != before
