"""keep_torch_out: transformers, with a torch installed, loads configs and tokenizers without
importing it (a stand-in torch package records whether anything imported it)."""

import subprocess
import sys

from mrv2_jax import envs
from tests.parity import FIXTURES

LOAD = ("from transformers import AutoConfig, AutoTokenizer; "
        f"print(AutoConfig.from_pretrained({str(FIXTURES / 'qwen3-tiny')!r}).model_type)")


def fake_torch(tmp_path):
    """A package named torch, with installed metadata (transformers checks the version), that
    leaves a file behind when imported."""
    site, marker = tmp_path / "site", tmp_path / "torch-was-imported"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n__version__ = '2.11.0'\n")
    (site / "torch-2.11.0.dist-info").mkdir()
    (site / "torch-2.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    return site, marker


def run(code, site):
    env = envs.subprocess_env() | {"PYTHONPATH": f"{site}:{envs.subprocess_env().get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_transformers_loads_a_config_without_importing_torch(tmp_path):
    site, marker = fake_torch(tmp_path)
    out = run(f"from mrv2_jax.without_torch import keep_torch_out; keep_torch_out(); {LOAD}", site)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "qwen3" and not marker.exists()
    # Without it, transformers imports the installed torch as soon as it loads.
    run(LOAD, site)
    assert marker.exists()
