"""scripts/hlo_fusions.py on real XLA dumps (XLA:CPU, a child process with --xla_dump_to): it finds a
fusion by name, prints the slice and sine its body computes and the instruction that reads it; with
--census it lists a while loop body's launching instructions by the JAX op they came from."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = """
import jax, jax.numpy as jnp
f = jax.jit(lambda x, y: jnp.cos(jnp.sin(x[1:3]) * y[:2] + 1.0) @ jnp.ones((2, 5)))
f(jnp.arange(4.0), jnp.ones(3)).block_until_ready()
"""
LOOP_PROGRAM = """
import jax, jax.numpy as jnp
def body(c):
    i, x = c
    return i + 1, jnp.cos(jnp.sin(x) * 2.0) @ jnp.ones((4, 4))
f = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x)))
f(jnp.ones((4, 4)))[1].block_until_ready()
"""


def dump_and_load(program: str, dump_dir: Path):
    """Run `program` with XLA dumping its optimized HLO into `dump_dir`; -> the script as a module."""
    env = os.environ | {"XLA_FLAGS": f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=120)
    spec = importlib.util.spec_from_file_location("hlo_fusions", ROOT / "scripts" / "hlo_fusions.py")
    hlo_fusions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hlo_fusions)
    return hlo_fusions


def test_the_fusion_its_body_and_its_reader(tmp_path):
    found = dump_and_load(PROGRAM, tmp_path).main([str(tmp_path), "fusion", "--contains", "sine"])
    assert found, sorted(p.name for p in tmp_path.iterdir())
    body = "\n".join(line for fusion in found for line in fusion["body"])
    assert "slice(" in body and "sine(" in body
    # The elementwise fusion's result feeds the dot (or the fusion holding it).
    assert any(fusion["users"] for fusion in found), found


def test_the_census_lists_a_loop_bodys_launches(tmp_path):
    """The while loop's body computation is listed with its fusions, each named by the JAX op it came
    from; a fusion's own body computation is not listed."""
    modules = dump_and_load(LOOP_PROGRAM, tmp_path).main([str(tmp_path), "--census", "--contains", "while"])
    computations = {name: rows for module in modules for name, rows in module["computations"].items()}
    ops = [row["op_name"] for rows in computations.values() for row in rows]
    assert any("while/body" in op and ("sin" in op or "cos" in op or "mul" in op) for op in ops), computations
    assert not any(name.startswith("fused_") for name in computations), sorted(computations)
