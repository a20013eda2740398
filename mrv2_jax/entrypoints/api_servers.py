"""Several API server processes on one engine: `mrv2-jax serve --api-server-count N`.

One Python process writes only so many server-sent events per second; with hundreds of streams
the HTTP, detokenization and SSE work of one process falls behind the engine, and streams get
their tokens in bunches. With N > 1 the serving process (index 0) starts the engine with N
endpoint pairs (`CoreClient`), then starts N - 1 more API processes (spawn), each with an
`AttachedCoreClient` on its own pair. All of them listen on the same host:port with SO_REUSEPORT,
so the kernel spreads new connections over them; each detokenizes and streams its own requests.

Stopping: SIGTERM to the serving process is passed on at once, so every process drains its own
requests (uvicorn's graceful shutdown) at the same time; the serving process then waits for the
others and stops the engine last. Ctrl-C in a terminal reaches every process of the group by
itself. If the engine dies, every process's streams end with an error and /health turns 503; if
the serving process dies, the others see it and exit; if another API process dies, the serving
process stops the server (its connections are gone, and the engine must not keep writing to it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
from multiprocessing.connection import wait

from mrv2_jax.without_torch import keep_torch_out

logger = logging.getLogger(__name__)


# CPU cores per API server process in `serve`'s default, and the most it starts by default.
CORES_PER_API_SERVER = 4
MAX_DEFAULT_API_SERVERS = 4


def default_api_server_count(cpu_count: int | None = None) -> int:
    """`serve`'s API server processes when not given: one per CORES_PER_API_SERVER cores (the engine
    process and the clients need cores too), at least 1, at most MAX_DEFAULT_API_SERVERS."""
    if cpu_count is None:
        cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, cpu_count // CORES_PER_API_SERVER))


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port that other processes may bind too (SO_REUSEPORT)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


class ApiServerProcesses:
    """The API processes beside the serving one: started with `start` (or `start_beside` a server
    that already serves), told to drain with `signal`, waited for (then killed if they hang) with
    `stop`."""

    def __init__(self, endpoints: list[list[tuple[str, str]]], host: str, port: int, server_kwargs: dict,
                 startup_timeout: float):
        """`endpoints`: per API process, its (input, output) pair on each engine process."""
        self._ctx = multiprocessing.get_context("spawn")
        self._endpoints, self._host, self._port = endpoints, host, port
        self._server_kwargs, self._startup_timeout = server_kwargs, startup_timeout
        self.processes: list[multiprocessing.Process] = []
        self._stopping = False
        self._spawning = threading.Lock()  # `stop` waits for a start under way: no process is left behind
        self.failure: str | None = None  # why the start failed

    def start(self) -> None:
        """Start them and wait until each listens; RuntimeError (after stopping them) if one fails."""
        waiting = {}
        with self._spawning:
            for index, pairs in enumerate(self._endpoints, start=1):
                if self._stopping:
                    break
                receive, send = self._ctx.Pipe(duplex=False)
                proc = self._ctx.Process(target=run_attached_api_server, name=f"mrv2-api-server-{index}",
                                         args=(index, pairs, self._host, self._port,
                                               self._server_kwargs, self._startup_timeout, send))
                proc.start()
                send.close()
                self.processes.append(proc)
                waiting[receive] = index
        try:
            while waiting:
                ready = wait(list(waiting), timeout=self._startup_timeout)
                if not ready:
                    raise RuntimeError(f"API server process(es) {sorted(waiting.values())} did not start "
                                       f"within {self._startup_timeout:.0f} s")
                for conn in ready:
                    index = waiting.pop(conn)
                    try:
                        status = conn.recv()
                    except EOFError:
                        status = f"it exited during start-up (exit code {self.processes[index - 1].exitcode})"
                    if status != "listening":
                        raise RuntimeError(f"API server process {index} failed to start: {status}")
        except BaseException as exc:
            if not self._stopping:  # not a start cut short by `stop`
                self.failure = str(exc)
            self.stop(timeout=5.0)
            raise

    def start_beside(self, server) -> None:
        """Start them on a thread while `server` (the serving process's) already serves: the port
        hands a connection only to processes that listen (SO_REUSEPORT), so the first requests do
        not wait for the others' start-up. If one fails to start (`failure` says why) or later
        exits before it is told to, `server` is stopped."""
        def run():
            try:
                self.start()
            except Exception:  # noqa: BLE001 - `failure` says why, and the server stops
                if self.failure is not None:
                    logger.error("%s: stopping the server", self.failure)
                    server.should_exit = True
                return
            self.stop_server_if_one_exits(server)

        threading.Thread(target=run, name="mrv2-api-servers-start", daemon=True).start()

    def stop_server_if_one_exits(self, server) -> None:
        """Stop `server` (the serving process's) if an API process exits before it is told to: its
        clients are gone, and nothing must keep sending to it."""
        def watch():
            wait([proc.sentinel for proc in self.processes])
            if not self._stopping:
                died = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]
                logger.error("API server process %s exited: stopping the server", ", ".join(died))
                server.should_exit = True

        threading.Thread(target=watch, name="mrv2-api-servers-watch", daemon=True).start()

    def signal(self, signum: int) -> None:
        self._stopping = True
        for proc in self.processes:
            if proc.is_alive():
                os.kill(proc.pid, signum)

    def stop(self, timeout: float) -> None:
        """SIGTERM (they drain their requests), wait up to `timeout` s, then kill what is left."""
        self._stopping = True
        with self._spawning:
            pass  # a start under way has spawned its last process
        self.signal(signal.SIGTERM)
        for proc in self.processes:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


def run_attached_api_server(index: int, pairs: list[tuple[str, str]], host: str, port: int,
                            server_kwargs: dict, startup_timeout: float, report) -> None:
    """An API server process's entry point: attach to the engine (or to each engine replica: one
    endpoint pair per engine process), listen, serve until a signal (or until the serving process
    is gone)."""
    keep_torch_out()  # before transformers loads: this process uses its tokenizers only
    from mrv2_jax.async_llm import AsyncLLM
    from mrv2_jax.core_client import AttachedCoreClient
    from mrv2_jax.data_parallel import AttachedReplicas
    from mrv2_jax.entrypoints.openai_server import import_lazy_modules, run_http_server
    from mrv2_jax.gc_heap import prepare_serving_heap

    logging.basicConfig(level=server_kwargs["log_level"].upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        client = (AttachedCoreClient(index, *pairs[0], startup_timeout) if len(pairs) == 1
                  else AttachedReplicas(index, pairs, startup_timeout))
        engine = AsyncLLM(client=client)
        sock = listening_socket(host, port)
    except BaseException as exc:  # noqa: BLE001 - the serving process says why and stops
        report.send(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    import_lazy_modules()
    prepare_serving_heap()
    report.send("listening")
    report.close()

    def exit_with_owner(server) -> None:  # the serving process (and with it the engine) is gone
        wait([multiprocessing.parent_process().sentinel])
        server.should_exit = True

    try:
        run_http_server(engine, sock=sock, on_started=lambda server: threading.Thread(
            target=exit_with_owner, args=(server,), daemon=True).start(), **server_kwargs)
    finally:
        engine.shutdown()
