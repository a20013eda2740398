"""Data-parallel replicas (`mrv2-jax serve --data-parallel-size N`): N engine processes, each with
its own devices, behind the one client interface the API server already talks to; with
`--api-server-count` too, every API process talks to every replica.

`EngineReplicas` starts N `CoreClient`s and looks like one of them to `AsyncLLM` (the other API
processes hold `AttachedReplicas`, one attached link per replica): a new request
goes to the replica with the fewest open requests (sent by this process and not finished), the
lower KV cache usage breaking ties; aborts and stop-string finishes follow the request to its
replica; the per-step messages of every replica come out of one `recv`, with the counters summed
over the replicas. The death of any replica stops the server, as a single engine's does.

Devices: replica i sees the i-th of the devices in CUDA_VISIBLE_DEVICES (all GPUs when unset),
through CUDA_VISIBLE_DEVICES in its process's environment. This process never starts a JAX backend,
so it holds no device memory.
"""

from __future__ import annotations

import threading

import msgspec
import zmq

from mrv2_jax import envs
from mrv2_jax.config import ENGINE_STARTUP_TIMEOUT
from mrv2_jax.core_client import AttachedCoreClient, CoreClient
from mrv2_jax.engine import core_messages as M

_SUMMED = ("num_running_reqs", "num_waiting_reqs", "num_free_blocks", "num_blocks", "prefix_cache_queries",
           "prefix_cache_hits", "num_preemptions", "num_steps", "num_fused_calls", "num_programs_pending")


def replica_devices(index: int, count: int) -> str:
    """CUDA_VISIBLE_DEVICES for replica `index` of `count`: one device each, from this process's list."""
    visible = [d for d in envs.read_external("CUDA_VISIBLE_DEVICES").split(",") if d.strip()]
    if not visible:
        return str(index)
    if len(visible) < count:
        raise ValueError(f"data_parallel_size {count} needs as many devices; CUDA_VISIBLE_DEVICES lists "
                         f"{len(visible)}")
    return visible[index]


def summed_stats(stats: list[M.CoreStats]) -> M.CoreStats:
    """The replicas' counters as one engine's: sums, and the KV usage of all blocks together."""
    total = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    used = sum(s.kv_cache_usage * s.num_blocks for s in stats)
    spec = [s.spec_decode for s in stats if s.spec_decode is not None]
    spec_total = ({key: sum(d[key] for d in spec) for key in spec[0]} if spec else None)
    return M.CoreStats(**total, kv_cache_usage=used / total["num_blocks"] if total["num_blocks"] else 0.0,
                       spec_decode=spec_total)


class _Replicas:
    """N engine links (`CoreClient`s this process started, or another API process's
    `AttachedCoreClient`s to them) behind one link's interface (send / recv / ready / stop / close)."""

    index = 0  # the API server process index
    attach_endpoints: list = []

    def _init_links(self, links: list) -> None:
        self.replicas = links
        first = links[0]
        self.tokenizer = first.tokenizer
        self._stats = [r.ready.stats for r in links]
        self.ready = msgspec.structs.replace(first.ready, stats=summed_stats(self._stats))
        self._replica_of: dict[str, int] = {}
        self._open = [0] * len(links)
        self._next = 0  # the replica whose messages `recv` looks at first
        self._lock = threading.Lock()
        self._poller = zmq.Poller()
        for r in links:
            for target in r.poll_targets:
                self._poller.register(target, zmq.POLLIN)

    @property
    def pids(self) -> list[int]:
        return [r.ready.pid for r in self.replicas]

    # --- commands ---------------------------------------------------------------------------
    def send(self, msg: M.ToEngine) -> None:
        if isinstance(msg, M.AddRequest):
            with self._lock:
                i = min(range(len(self.replicas)), key=lambda k: (self._open[k], self._stats[k].kv_cache_usage))
                self._replica_of[msg.request_id] = i
                self._open[i] += 1
            self.replicas[i].send(msg)
        elif isinstance(msg, (M.AbortRequests, M.FinishRequests)):
            for i, ids in self._split(msg.request_ids, forget=True).items():
                self.replicas[i].send(type(msg)(ids))
        else:  # Shutdown
            for r in self.replicas:
                r.send(msg)

    def _split(self, request_ids, forget: bool) -> dict[int, list[str]]:
        per_replica: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                i = self._replica_of.pop(rid, None) if forget else self._replica_of.get(rid)
                if i is not None:
                    per_replica.setdefault(i, []).append(rid)
                    if forget:
                        self._open[i] -= 1
        return per_replica

    # --- messages ---------------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> M.FromEngine | None:
        """The next message of any replica, its counters summed over all of them; EngineProcessDied
        once any replica has exited (after its last messages)."""
        events = dict(self._poller.poll(None if timeout is None else int(timeout * 1000)))
        n = len(self.replicas)
        for i in (self._next + k for k in range(n)):  # round robin: a busy replica never starves the others
            r = self.replicas[i % n]
            if any(target in events for target in r.poll_targets):
                self._next = (i + 1) % n
                return self._own(i % n, r.recv(0))
        return None

    def _own(self, i: int, msg):
        if isinstance(msg, M.StepOutputs):
            finished = [out.req_id for out in msg.outputs if out.finished] + [rid for rid, _ in msg.errors]
            self._split(finished, forget=True)
            self._stats[i] = msg.stats
            msg.stats = summed_stats(self._stats)
        return msg

    # --- life -------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return all(r.is_alive for r in self.replicas)

    def stop(self, timeout: float = 30.0) -> None:
        for r in self.replicas:  # all at once, then wait for each
            r.ask_to_stop()
        for r in self.replicas:
            r.stop(timeout)

    def close(self, timeout: float = 30.0) -> None:
        for r in self.replicas:
            r.close(timeout)


class EngineReplicas(_Replicas):
    """Starts N engine processes; with `api_server_count` > 1 each also serves that many - 1 other
    API processes, whose endpoint pairs on every replica are in `attach_endpoints`."""

    def __init__(self, engine_args: dict, count: int, startup_timeout: float = ENGINE_STARTUP_TIMEOUT,
                 api_server_count: int = 1):
        if count < 2:
            raise ValueError(f"EngineReplicas is for 2 or more replicas, got {count}")
        if engine_args.get("tensor_parallel_size", 1) > 1:  # each replica sees one device
            raise ValueError("data_parallel_size > 1 with tensor_parallel_size > 1 is not supported yet")
        if engine_args.get("pipeline_parallel_size", 1) > 1:
            raise ValueError("data_parallel_size > 1 with pipeline_parallel_size > 1 is not supported yet")
        self.replicas: list[CoreClient] = []
        try:
            for i in range(count):  # one after another: each start-up reads the compile cache the first filled
                with envs.child_environment(CUDA_VISIBLE_DEVICES=replica_devices(i, count)):
                    self.replicas.append(CoreClient(engine_args, startup_timeout, api_server_count))
        except BaseException:
            self.close(timeout=5.0)
            raise
        self._init_links(self.replicas)
        # Per other API process: its endpoint pair on each replica.
        self.attach_endpoints = [[r.attach_endpoints[j][0] for r in self.replicas]
                                 for j in range(api_server_count - 1)]


class AttachedReplicas(_Replicas):
    """Another API process's links to the replicas an `EngineReplicas` started: its endpoint pair
    on each. It balances the requests it sends itself; it neither starts nor stops an engine."""

    def __init__(self, index: int, pairs: list[tuple[str, str]], startup_timeout: float = ENGINE_STARTUP_TIMEOUT):
        self.index = index
        self.replicas: list[AttachedCoreClient] = []
        try:
            for input_addr, output_addr in pairs:
                self.replicas.append(AttachedCoreClient(index, input_addr, output_addr, startup_timeout))
        except BaseException:
            self.close()
            raise
        self._init_links(self.replicas)

    def stop(self, timeout: float = 30.0) -> None:
        """The engines belong to the serving process: nothing to stop here."""
