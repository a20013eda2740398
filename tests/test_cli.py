"""The README's main command, run as a user would (a subprocess), prints generated text."""

import subprocess
import sys


def test_generate_command_prints_text_from_the_demo_model():
    prompt = "The king said"
    run = subprocess.run([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "generate", "--prompt", prompt,
                          "--max-tokens", "24"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(prompt)
    generated = run.stdout[len(prompt):].strip()
    assert len(generated) >= 20
    # Recognisable text, not byte noise: mostly letters and spaces.
    assert sum(c.isalpha() or c.isspace() for c in generated) / len(generated) > 0.8


def test_unknown_model_is_a_clear_error():
    run = subprocess.run([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "generate", "--prompt", "x",
                          "--model", "no-such-model"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "no-such-model" in run.stderr
