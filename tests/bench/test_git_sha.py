"""Benchmarks stamp the commit of the checkout their code runs from, and say when its tracked files
differ from it (mrv2_jax/bench/environment.py `git_sha`), unless MRV2_GIT_SHA names one."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mrv2_jax.bench import environment

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(tree, *args) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_a_tree_reports_its_own_commit_and_whether_it_is_dirty(tmp_path, monkeypatch):
    # A copy of the package in a checkout of its own, as a second tree run through PYTHONPATH would be.
    source = Path(environment.__file__).resolve().parents[1]
    shutil.copytree(source, tmp_path / "mrv2_jax", ignore=shutil.ignore_patterns("__pycache__"))
    package = tmp_path / "mrv2_jax" / "bench"
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    monkeypatch.delenv("MRV2_GIT_SHA", raising=False)
    probe = [sys.executable, "-P", "-c", "from mrv2_jax.bench.environment import git_sha; print(git_sha())"]

    def stamped() -> str:
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        return subprocess.run(probe, capture_output=True, text=True, check=True, cwd="/", env=env).stdout.strip()

    assert stamped() == head != _git(source.parent, "rev-parse", "--short", "HEAD")
    (package / "environment.py").write_text((package / "environment.py").read_text() + "\n# changed\n")
    assert stamped() == f"{head}+dirty"
    monkeypatch.setenv("MRV2_GIT_SHA", "abc1234")
    assert environment.git_sha() == "abc1234"
