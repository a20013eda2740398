"""Two API server processes on one engine (`mrv2-jax serve --api-server-count 2`), over real HTTP
on 127.0.0.1, on the demo model. Each process is reached on purpose: a keep-alive connection whose
/health names the process carries the requests meant for it.

The reference for every output is the offline `LLM.generate` (not streamed), computed in this test
process on its own engine with the same weights.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mrv2_jax.async_llm import AsyncLLM
from mrv2_jax.entrypoints.api_servers import ApiServerProcesses, default_api_server_count, listening_socket
from mrv2_jax.entrypoints.openai_server import ServerThread
from mrv2_jax.sampling_params import SamplingParams
from tests.entrypoints.test_serve_cli import ENGINE_FLAGS, _children, _free_port, _gone
from tests.server_harness import ENGINE_ARGS, MODEL_NAME, reference_llm, wait_until

PROMPTS = [["The king said", "A soldier cried", "The queen asked"],  # to API process 0
           ["Romeo whispered", "Juliet answered", "The duke swore"]]  # to API process 1
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = dict(max_tokens=200, temperature=0.0, ignore_eos=True)


def _pinned(url: str, index: int, timeout: float = 120.0) -> httpx.Client:
    """A client whose keep-alive connection reaches API process `index` (the serving process
    serves before the others listen: they start beside it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client = httpx.Client(base_url=url, timeout=120)
        if client.get("/health").json()["api_server"] == index:
            return client
        client.close()
        time.sleep(0.02)
    raise AssertionError(f"no connection reached API process {index} in {timeout:.0f} s")


def _stream_text(client: httpx.Client, prompt: str, **params) -> tuple[str, str | None]:
    """(streamed text, last finish_reason) of one streamed completion."""
    text, reason = "", None
    with client.stream("POST", "/v1/completions",
                       json={"model": MODEL_NAME, "prompt": prompt, "stream": True, **params}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: "):])["choices"][0]
                text, reason = text + choice["text"], choice["finish_reason"] or reason
    return text, reason


def _metrics(client: httpx.Client) -> dict:
    return {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}


def _reference(llm, prompts: list[str], params: dict) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_two_api_processes_stream_their_own_requests_and_drain_together(tmp_path):
    """The command as a user runs it: both processes stream (concurrently) exactly the offline
    outputs of their own requests; a client leaving process 1 frees its blocks; SIGTERM to the
    serving process lets a stream on process 1 finish, then every process exits."""
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "serve", MODEL_NAME,
                                 "--port", str(port), "--api-server-count", "2", "--log-level", "warning",
                                 "--shutdown-timeout", "60", *ENGINE_FLAGS], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    llm = reference_llm()
    reference = _reference(llm, PROMPTS[0] + PROMPTS[1] + ["Once upon a time,"], GREEDY)
    reference_long = _reference(llm, ["Once upon a time,"], LONG)[0]
    try:
        wait_until(lambda: proc.poll() is not None or _healthy(url), timeout=300, what="the server to come up")
        assert proc.poll() is None, log.read_text()
        clients = [_pinned(url, 0), _pinned(url, 1)]
        results: dict[int, list] = {}

        def run(index):
            results[index] = [_stream_text(clients[index], p, **GREEDY) for p in PROMPTS[index]]

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [text for text, _ in results[0] + results[1]] == reference[:6]
        assert all(reason == "length" for _, reason in results[0] + results[1])
        # Either process's /metrics counts the requests of both.
        for client in clients:
            counted = _metrics(client)
            assert counted["mrv2_requests_total"] == 6
            assert counted["mrv2_generation_tokens_total"] == 6 * GREEDY["max_tokens"]
            assert counted["mrv2_time_to_first_token_seconds_count"] == 6

        # Process 1's client hangs up mid-stream: the engine aborts it and every block is free again.
        with clients[1].stream("POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS[1][0],
                                                                "stream": True, **LONG}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 4:
                    break
        clients[1].close()
        clients[1] = _pinned(url, 1)
        wait_until(lambda: _metrics(clients[1])["mrv2_kv_cache_free_blocks"] == ENGINE_ARGS["num_gpu_blocks"]
                   and _metrics(clients[1])["mrv2_num_requests_running"] == 0, what="the aborted request's blocks")
        assert _metrics(clients[1])["mrv2_requests_aborted_total"] == 1  # counted where the client left

        # SIGTERM to the serving process while process 1 streams: the stream still ends complete.
        streamed = {}
        stream = threading.Thread(target=lambda: streamed.update(out=_stream_text(clients[1], "Once upon a time,",
                                                                                  **LONG)))
        stream.start()
        wait_until(lambda: _metrics(clients[0])["mrv2_num_requests_running"] == 1, what="the stream to start")
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        stream.join(120)
        assert streamed["out"] == (reference_long, "length")
        assert proc.wait(120) == 0, log.read_text()
        wait_until(lambda: all(_gone(pid) for pid in children), what="the API process and the engine to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_killed_engine_ends_the_streams_of_every_api_process():
    """The engine process is killed while each API process streams: both streams end with an error
    event naming the exit, and both processes answer 503 from then on. Then the other API process
    is killed, and the serving process is told to stop its server."""
    engine = AsyncLLM.from_engine_args(MODEL_NAME, api_server_count=2, **ENGINE_ARGS)
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    others = ApiServerProcesses(engine.client.attach_endpoints, "127.0.0.1", port,
                                dict(log_level="warning", shutdown_timeout=5.0, served_model_names=MODEL_NAME), 120.0)
    try:
        others.start()
        with ServerThread(engine, sock=sock, served_model_names=MODEL_NAME) as server:
            clients = [_pinned(server.url, 0), _pinned(server.url, 1)]
            events: dict[int, list[str]] = {0: [], 1: []}
            started = [threading.Event(), threading.Event()]

            def run(index):
                body = {"model": MODEL_NAME, "prompt": PROMPTS[index][0], "stream": True, **LONG}
                with clients[index].stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events[index].append(line)
                            started[index].set()

            threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
            for t in threads:
                t.start()
            assert all(e.wait(120) for e in started)
            os.kill(engine.engine_pid, signal.SIGKILL)
            for t in threads:
                t.join(60)
                assert not t.is_alive(), "a stream did not end"
            for index in (0, 1):
                assert events[index][-1] == "data: [DONE]"
                error = json.loads(events[index][-2][len("data: "):])["error"]
                assert error["code"] == "engine_dead" and "exit code -9" in error["message"], (index, error)
                r = clients[index].get("/health")
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
                r = clients[index].post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
                clients[index].close()
        # An API process that dies stops the serving process's server (here a stand-in with the flag).
        serving = SimpleNamespace(should_exit=False)
        others.stop_server_if_one_exits(serving)
        os.kill(others.processes[0].pid, signal.SIGKILL)
        wait_until(lambda: serving.should_exit, what="the serving process's server to be told to stop")
    finally:
        others.stop(timeout=10.0)
        engine.shutdown()
    assert all(not p.is_alive() for p in others.processes)


def test_the_api_server_processes_load_no_jax():
    # Each API process imports the server and the engine client only; the engine (and JAX with it)
    # loads in the engine process. Several API processes then start fast and hold no device code.
    code = ("import sys, mrv2_jax.entrypoints.cli, mrv2_jax.entrypoints.openai_server, "
            "mrv2_jax.entrypoints.api_servers, mrv2_jax.data_parallel; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_serve_starts_one_api_process_per_four_cores_by_default():
    from mrv2_jax.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve"]).api_server_count is None  # resolved by `serve`
    cores_to_count = {1: 1, 2: 1, 7: 1, 8: 2, 12: 3, 16: 4, 128: 4}
    assert {c: default_api_server_count(c) for c in cores_to_count} == cores_to_count
    assert 1 <= default_api_server_count() <= 4


def test_an_api_process_that_fails_to_start_beside_a_serving_one_stops_it(tmp_path):
    """`serve` starts the other API processes while its own server already serves; one that cannot
    start (here: no engine ever answers on its endpoints) stops that server and says why."""
    sock = listening_socket("127.0.0.1", 0)
    endpoints = [[(f"ipc://{tmp_path}/input1", f"ipc://{tmp_path}/output1")]]
    others = ApiServerProcesses(endpoints, "127.0.0.1", sock.getsockname()[1], dict(log_level="warning"),
                                startup_timeout=2.0)
    serving = SimpleNamespace(should_exit=False)
    try:
        others.start_beside(serving)
        wait_until(lambda: serving.should_exit, timeout=120, what="the serving server to be told to stop")
        # Either the process said why (no engine was ready in 2 s) or the wait for it ran out first.
        assert re.search(r"API server process(\(es\) \[1\] did not start| 1 failed to start)", others.failure)
    finally:
        others.stop(timeout=10.0)
        sock.close()
    assert all(not p.is_alive() for p in others.processes)
