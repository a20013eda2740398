"""Several processes, one engine (engine/distributed.py): two processes on 127.0.0.1, one CPU
device each, joined by jax.distributed (gloo collectives), run the demo model split over both
(tensor_parallel_size=2), and each one's greedy tokens equal one device's in one process; what a
multi-process run does not support is refused by name."""

import functools
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mrv2_jax import envs
from mrv2_jax.engine.engine_config import EngineConfig
from tests.runner import multihost_run

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference() -> list[list[int]]:
    """The same requests on one device in this process (the suite's one CPU device)."""
    from mrv2_jax.llm import LLM

    llm = LLM(**multihost_run.ENGINE)
    return [list(o.outputs[0].token_ids) for o in llm.generate(multihost_run.PROMPTS, multihost_run.GREEDY,
                                                               use_tqdm=False)]


@functools.cache
def runs() -> tuple[list[dict], list[list[int]]]:
    """-> (each process's JSON line, the one-device tokens); the reference runs while the two
    children do, and a child still running when this returns or fails is killed."""
    flags = f"{envs.get_xla_flags()} --xla_force_host_platform_device_count=1".strip()
    env = envs.subprocess_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    port = free_port()
    children = [subprocess.Popen([sys.executable, "-m", "tests.runner.multihost_run", str(i), str(port)], cwd=ROOT,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        expected = reference()
        outputs = []
        for child in children:
            out, err = child.communicate(timeout=TIMEOUT_S)
            assert child.returncode == 0, err[-4000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
        return outputs, expected
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_two_processes_give_one_devices_tokens():
    outputs, expected = runs()
    assert [o["process"] for o in outputs] == [[0, 2], [1, 2]]
    assert [o["config_process_id"] for o in outputs] == [0, 1]
    for out in outputs:
        assert out["greedy"] == expected, out["process"]
        assert out["fused_calls"] > 0  # fused decode ran across the processes too


def test_the_mesh_spans_both_processes_and_each_holds_its_half():
    for out in runs()[0]:
        assert out["mesh_processes"] == [0, 1]
        assert not out["fully_addressable"]  # global arrays: the other half is the other process's
        assert out["kv"] == [[4, 32, 2, 4, 64], [4, 32, 1, 4, 64]]  # 2 KV heads, one per process
        shape, shards = out["split_weight"]
        assert len(shards) == 1 and shards[0] != shape  # one local shard, a part of the whole


def test_unseeded_sampling_agrees_across_processes():
    """Requests without a seed draw theirs from one generator that process 0 seeded for all."""
    first, second = runs()[0]
    assert first["sampled"] == second["sampled"]
    assert all(len(tokens) == multihost_run.UNSEEDED.max_tokens for tokens in first["sampled"])


# --- what is refused, before any process waits for the others ------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(num_processes=2), "tensor_parallel_size must be a multiple of 2"),
    (dict(num_processes=2, tensor_parallel_size=3), "got tensor_parallel_size=3"),
    (dict(num_processes=2, tensor_parallel_size=2, runner="v1"), "tensor_parallel_size=2 needs the v2 runner"),
    (dict(num_processes=2, tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "tensor_parallel_size=2 with speculative_config"),
    (dict(num_processes=2, tensor_parallel_size=2, process_id=2), r"process_id must be an int in \[0, 2\)"),
    (dict(num_processes=0), "num_processes must be an int >= 1"),
    (dict(coordinator_address="127.0.0.1:1234"), "coordinator_address / process_id need num_processes > 1"),
])
def test_engine_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_an_engine_after_jax_started_is_refused():
    import jax

    jax.devices()  # this process's backend is up (else the engine would wait for a second process)
    with pytest.raises(ValueError, match="build the engine before anything else in this process uses JAX"):
        EngineConfig(num_processes=2, tensor_parallel_size=2, process_id=0,
                     coordinator_address=f"127.0.0.1:{free_port()}")


def test_the_environment_is_the_fallback(monkeypatch):
    monkeypatch.setenv("MRV2_NUM_PROCESSES", "2")
    monkeypatch.setenv("MRV2_PROCESS_ID", "5")
    with pytest.raises(ValueError, match=r"process_id must be an int in \[0, 2\), got 5"):
        EngineConfig(tensor_parallel_size=2)
    monkeypatch.setenv("MRV2_PROCESS_ID", "x")
    with pytest.raises(ValueError, match="MRV2_PROCESS_ID must be an integer >= 0"):
        EngineConfig(tensor_parallel_size=2)


def test_serving_across_processes_is_refused(monkeypatch):
    from mrv2_jax.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2", "--num-processes",
                                      "2", "--coordinator-address", "10.0.0.1:1234", "--process-id", "1"])
    assert {k: engine_kwargs(args)[k] for k in ("num_processes", "coordinator_address", "process_id")} == {
        "num_processes": 2, "coordinator_address": "10.0.0.1:1234", "process_id": 1}
    from mrv2_jax.async_llm import AsyncLLM
    from mrv2_jax.entrypoints.cli import cmd_serve

    with pytest.raises(ValueError, match="num_processes=2: serving"):
        cmd_serve(build_parser().parse_args(["serve", "--num-processes", "2", "--tensor-parallel-size", "2"]))

    with pytest.raises(ValueError, match=r"num_processes=2: serving \(mrv2-jax serve, AsyncLLM\) is not supported"):
        AsyncLLM.from_engine_args("demo", num_processes=2, tensor_parallel_size=2)
    monkeypatch.setenv("MRV2_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="only the offline API"):
        AsyncLLM.from_engine_args("demo", tensor_parallel_size=2)
