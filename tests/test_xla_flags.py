"""The default XLA flags: added when absent, never overriding what the user set."""

from mrv2_jax.xla_flags import apply_default_xla_flags


def test_default_flags_are_added_only_when_absent(monkeypatch):
    monkeypatch.delenv("MRV2_DEFAULT_XLA_FLAGS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    apply_default_xla_flags()
    import os

    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer=+WHILE"
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")  # the user turned them off
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer="
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("MRV2_DEFAULT_XLA_FLAGS", "0")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == ""
