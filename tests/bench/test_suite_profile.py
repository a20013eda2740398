"""benchmarks.suite_profile: a pytest run with the plugin records each test's JAX compile work,
and the summary adds it up by module."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import suite_profile

ROOT = Path(__file__).resolve().parents[2]
TESTS = '''
import jax, jax.numpy as jnp

square = jax.jit(lambda x: x * x)

def test_compiles_once():
    assert float(square(jnp.float32(3.0))) == 9.0

def test_reuses_the_compiled_program():
    assert float(square(jnp.float32(4.0))) == 16.0

def test_no_jax():
    assert sum(range(4)) == 6
'''


def test_records_each_tests_compiles_and_sums_them_by_module(tmp_path, capsys):
    (tmp_path / "test_sample.py").write_text(TESTS)
    out = tmp_path / "profile"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.suite_profile",
               "--suite-profile-dir", str(out), "test_sample.py"]
    run = subprocess.run(command,
                         cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    records = {r["test"].split("::")[1]: r for r in json.loads((out / "suite_profile_main.json").read_text())}
    assert set(records) == {"test_compiles_once", "test_reuses_the_compiled_program", "test_no_jax"}
    first, again, none = (records[n] for n in ("test_compiles_once", "test_reuses_the_compiled_program", "test_no_jax"))
    assert first["compiles"] >= 1 and first["compile"] > 0 and first["trace"] > 0
    assert again["compiles"] == 0 and none["compiles"] == 0 and none["trace"] == 0
    assert all(r["wall"] >= r["compile"] for r in records.values())
    modules = suite_profile.by_module(list(records.values()))
    assert modules["test_sample.py"]["tests"] == 3
    assert modules["test_sample.py"]["compiles"] == first["compiles"]
    suite_profile.main([str(out / "suite_profile_main.json")])
    assert "test_sample.py" in capsys.readouterr().out
