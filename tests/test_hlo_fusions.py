"""scripts/hlo_fusions.py on a real XLA dump (XLA:CPU, a child process with --xla_dump_to): it finds the
fusion by name, prints the slice and sine its body computes and the instruction that reads it."""

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


def test_the_fusion_its_body_and_its_reader(tmp_path):
    env = os.environ | {"XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=120)
    spec = importlib.util.spec_from_file_location("hlo_fusions", ROOT / "scripts" / "hlo_fusions.py")
    hlo_fusions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hlo_fusions)
    found = hlo_fusions.main([str(tmp_path), "fusion", "--contains", "sine"])
    assert found, sorted(p.name for p in tmp_path.iterdir())
    body = "\n".join(line for fusion in found for line in fusion["body"])
    assert "slice(" in body and "sine(" in body
    # The elementwise fusion's result feeds the dot (or the fusion holding it).
    assert any(fusion["users"] for fusion in found), found


def test_the_census_lists_a_loop_bodys_launches(tmp_path):
    """--census: the while loop's body computation is listed with its fusions, each named by the JAX op it
    came from; a fusion's own body computation is not listed."""
    program = """
import jax, jax.numpy as jnp
def body(c):
    i, x = c
    return i + 1, jnp.cos(jnp.sin(x) * 2.0) @ jnp.ones((4, 4))
f = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x)))
f(jnp.ones((4, 4))).__getitem__(1).block_until_ready()
"""
    env = os.environ | {"XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=120)
    spec = importlib.util.spec_from_file_location("hlo_fusions", ROOT / "scripts" / "hlo_fusions.py")
    hlo_fusions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hlo_fusions)
    modules = hlo_fusions.main([str(tmp_path), "--census", "--contains", "while"])
    computations = {name: rows for module in modules for name, rows in module["computations"].items()}
    ops = [row["op_name"] for rows in computations.values() for row in rows]
    assert any("while/body" in op and ("sin" in op or "cos" in op or "mul" in op) for op in ops), computations
    assert not any(name.startswith("fused_") for name in computations), sorted(computations)
