"""`mrv2-jax serve` as a user runs it: a subprocess that serves, answers, and drains and stops on SIGTERM;
and the wiring of its options (key from the environment, model names, safe host default)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mrv2_jax.entrypoints import cli
from tests.server_harness import ENGINE_ARGS
from tests.test_without_torch import fake_torch

# The same engine shapes as the other server tests, so the compilation cache is shared.
ENGINE_FLAGS = ["--runner", ENGINE_ARGS["runner"], "--dtype", ENGINE_ARGS["dtype"],
                "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]),
                "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
                "--max-model-len", str(ENGINE_ARGS["max_model_len"]), "--block-size", str(ENGINE_ARGS["block_size"]),
                "--num-gpu-blocks", str(ENGINE_ARGS["num_gpu_blocks"]),
                "--sampler-variants", ENGINE_ARGS["sampler_variants"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> set[int]:
    """The child processes of `pid` (Linux /proc)."""
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids |= {int(k) for k in (task / "children").read_text().split()}
    return kids


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_serve_subprocess_answers_then_drains_on_sigterm_and_leaves_no_engine(tmp_path):
    """The real command: the engine in its own process; SIGTERM lets the stream in flight finish,
    then the server exits 0 and its engine process is gone. An installed torch stays unimported in
    both processes (mrv2_jax/without_torch.py)."""
    port = _free_port()
    site, torch_marker = fake_torch(tmp_path)
    env = os.environ | {"MRV2_API_KEY": "k1", "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"}
    log = tmp_path / "serve.log"  # a file, not a pipe: a full pipe would block the server
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "serve", "demo",
                                 "--port", str(port), "--served-model-name", "poet", "--log-level", "info",
                                 "--shutdown-timeout", "60", *ENGINE_FLAGS], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        engines = _children(proc.pid)
        assert engines, "the engine runs in a child process"
        auth = {"Authorization": "Bearer k1"}
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from MRV2_API_KEY
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": "poet", "prompt": "The king said", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        body = {"model": "poet", "prompt": "The king said", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", url + "/v1/completions", headers=auth, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
                    events.append(line[len("data: "):])
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 48  # drained, not cut
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()
    assert not torch_marker.exists()
    # The start-up line: seconds since the process started, at each milestone in order.
    line = next(x for x in log.read_text().splitlines() if "API process start-up: " in x)
    startup = json.loads(line.split("API process start-up: ", 1)[1])
    assert 0 < startup["serve_entered_s"] <= startup["engine_ready_s"] <= startup["server_imports_done_s"]
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in engines):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.1)


def test_serve_options_reach_the_server(monkeypatch):
    seen = {}
    monkeypatch.setattr("mrv2_jax.async_llm.AsyncLLM.from_engine_args",
                        staticmethod(lambda **kw: seen.setdefault("engine_args", kw)))
    monkeypatch.setattr("mrv2_jax.entrypoints.openai_server.serve",
                        lambda engine, host, port, **kw: seen.update(host=host, port=port, **kw))
    monkeypatch.setenv("MRV2_API_KEY", "from-env")
    assert cli.main(["serve", "some/model/dir", "--max-num-seqs", "4"]) == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8000  # loopback unless asked
    assert seen["api_key"] == "from-env" and seen["served_model_names"] == ["some/model/dir"]
    assert seen["engine_args"]["model"] == "some/model/dir" and seen["engine_args"]["max_num_seqs"] == 4
    assert seen["max_body_bytes"] == 1 << 20 and seen["shutdown_timeout"] == 30
    assert seen["engine_args"]["engine_in_process"] is False and seen["engine_args"]["stream_interval"] == 1
    assert cli.main(["serve", "a", "--model", "b"]) == 2  # two different models: an error, not a guess
