"""Two engine replicas behind one server (`--data-parallel-size 2`), over real HTTP on 127.0.0.1, on
the demo model: concurrent streams are spread over both engine processes and each gets exactly the
offline output (the reference: `LLM.generate` in this process, not streamed); the counters are the
replicas' sums; a killed replica ends every open stream and turns the server 503."""

import os
import signal
import subprocess
import sys
import threading

import httpx

from mrv2_jax.async_llm import AsyncLLM
from mrv2_jax.data_parallel import replica_devices, summed_stats
from mrv2_jax.engine import core_messages as M
from mrv2_jax.entrypoints.openai_server import ServerThread
from mrv2_jax.sampling_params import SamplingParams
from tests.server_harness import ENGINE_ARGS, MODEL_NAME, error_event_after_kill, reference_llm, stream_all, wait_until

PROMPTS = [f"{who} {verb}" for who in ("The king", "Romeo", "A soldier", "Juliet") for verb in ("said", "cried")]
PARAMS = [dict(max_tokens=12, temperature=0.0, ignore_eos=True) if i % 2 else
          dict(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]


def test_two_replicas_share_the_streams_and_give_the_offline_outputs():
    engine = AsyncLLM.from_engine_args(MODEL_NAME, data_parallel_size=2, **ENGINE_ARGS)
    reference = [o.outputs[0].text for o in reference_llm().generate(
        PROMPTS, [SamplingParams(**kw) for kw in PARAMS], use_tqdm=False)]
    replicas = engine.client.replicas
    try:
        assert len({r.ready.pid for r in replicas} | {os.getpid()}) == 3  # two engine processes
        with ServerThread(engine, served_model_names=MODEL_NAME) as server:
            results = stream_all(server.url, [{"prompt": p, **kw} for p, kw in zip(PROMPTS, PARAMS)])
            assert ["".join(e["choices"][0]["text"] for e in events) for events in results] == reference
            # Both replicas stepped (each took about half the requests), and the server's counters
            # are their sums: every block of both is free again.
            per_replica = engine.client._stats
            assert all(s.num_steps > 0 for s in per_replica), per_replica
            wait_until(lambda: engine.stats.num_running_reqs == 0 and
                       engine.stats.num_free_blocks == 2 * ENGINE_ARGS["num_gpu_blocks"], what="all blocks free")

            # One replica dies mid-stream: the stream ends with an error event, and the server is 503.
            body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
            error = error_event_after_kill(server.url, body, replicas[1].ready.pid)
            assert error["code"] == "engine_dead" and "exit code -9" in error["message"], error
            assert httpx.get(server.url + "/health").status_code == 503
    finally:
        engine.shutdown()
    assert not any(r.process.is_alive() for r in replicas)


def test_replica_devices_and_summed_counters(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert [replica_devices(i, 2) for i in (0, 1)] == ["4", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert replica_devices(1, 2) == "1"
    a = M.CoreStats(num_running_reqs=2, num_free_blocks=30, num_blocks=40, kv_cache_usage=0.25, num_steps=5)
    b = M.CoreStats(num_running_reqs=1, num_free_blocks=10, num_blocks=20, kv_cache_usage=0.5, num_steps=7)
    total = summed_stats([a, b])
    assert (total.num_running_reqs, total.num_free_blocks, total.num_blocks, total.num_steps) == (3, 40, 60, 12)
    assert abs(total.kv_cache_usage - (0.25 * 40 + 0.5 * 20) / 60) < 1e-12


def test_two_replicas_behind_two_api_processes(tmp_path):
    """`serve --data-parallel-size 2 --api-server-count 2`: each API process sends to both replicas;
    every stream is the offline output, either process's /metrics counts all requests, and SIGTERM
    ends every process."""
    from tests.entrypoints.test_api_servers import _healthy, _metrics, _pinned, _stream_text
    from tests.entrypoints.test_serve_cli import ENGINE_FLAGS, _children, _free_port, _gone

    port, log = _free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mrv2_jax.entrypoints.cli", "serve", MODEL_NAME,
                                 "--port", str(port), "--data-parallel-size", "2", "--api-server-count", "2",
                                 "--log-level", "warning", *ENGINE_FLAGS], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[:2], PROMPTS[2:4]]  # to API process 0, to API process 1
    reference = [o.outputs[0].text for o in reference_llm().generate(
        prompts[0] + prompts[1], SamplingParams(**greedy), use_tqdm=False)]
    try:
        wait_until(lambda: proc.poll() is not None or _healthy(url), timeout=300, what="the server to come up")
        assert proc.poll() is None, log.read_text()
        clients = [_pinned(url, 0), _pinned(url, 1)]
        results: dict[int, list] = {}
        threads = [threading.Thread(target=lambda i=i: results.update(
            {i: [_stream_text(clients[i], p, **greedy)[0] for p in prompts[i]]})) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert results[0] + results[1] == reference
        for client in clients:
            assert _metrics(client)["mrv2_requests_total"] == 4
            # The counters come with the engines' step messages: the last frees show one step later.
            wait_until(lambda c=client: _metrics(c)["mrv2_kv_cache_free_blocks"] == 2 * ENGINE_ARGS["num_gpu_blocks"],
                       what="every block of both replicas to be free again")
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()
        wait_until(lambda: all(_gone(pid) for pid in children), what="the API process and the replicas to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
