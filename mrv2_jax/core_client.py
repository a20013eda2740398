"""An API server process's handle on the engine-core process (engine/core_proc.py): send it
commands, receive its per-step messages, notice when it dies.

`CoreClient` starts the engine process (the `spawn` method: JAX is not fork-safe; it inherits this
process's environment: XLA_FLAGS, MRV2_COMPILATION_CACHE, ...), waits until it is ready and stops
it at the end. With several API server processes (`--api-server-count N`) it starts the engine
with N pairs of ZMQ endpoints and keeps the first; each other API process takes one pair with
`AttachedCoreClient`. Every pair is two ipc:// sockets in a private temporary directory: commands
out (PUSH, any thread, serialised by a lock) and step messages in (PULL, one reader thread).

Death is seen at once: the owner's `recv` polls the engine process's sentinel beside the socket,
so a killed engine is noticed without any timeout, and the owner then tells the attached clients
(an `EngineDied` message into their sockets); an attached client also watches the process that
started it (the owner), so it never outlives it.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import threading
import time
from pathlib import Path

import zmq

from mrv2_jax.config import ENGINE_STARTUP_TIMEOUT
from mrv2_jax.engine import core_messages as M
from mrv2_jax.engine.engine_config import EngineConfig
from mrv2_jax.engine.tokenizer import TokenizerPreload, load_tokenizer
from mrv2_jax.models.paths import resolve_model_path
from mrv2_jax.without_torch import keep_torch_out


def _tokenizer_path(engine_args: dict) -> Path | None:
    """Where the engine process will load its tokenizer from (it says so when ready)."""
    if engine_args.get("tokenizer"):
        return Path(engine_args["tokenizer"])
    try:
        return resolve_model_path(engine_args.get("model"))
    except FileNotFoundError:  # the engine process reports it
        return None


class EngineStartupError(RuntimeError):
    """The engine process did not become ready (it failed, died, or took too long)."""


class EngineProcessDied(RuntimeError):
    """The engine process has exited."""

    def __init__(self, exitcode: int | None):
        super().__init__(f"the engine process exited (exit code {exitcode})")
        self.exitcode = exitcode


class _EngineLink:
    """One API process's pair of sockets to the engine, and the ready handshake."""

    index = 0  # which API server process this is (its requests' outputs come to it)

    def _bind(self, input_addr: str, output_addr: str) -> None:
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block a sender; a dead engine is refused earlier
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        self._encoder = M.encoder()
        self._decoder = M.from_engine_decoder()
        # Re-entrant: a stream dropped during a send may abort its request (garbage collection).
        self._send_lock = threading.RLock()
        self._closed = False
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)

    @property
    def poll_targets(self) -> tuple:
        """What `recv` waits on (the output socket, the sentinel of the process it watches: the
        engine, or for an attached client the serving process), for a poller over several links."""
        return self._output, self._watched_sentinel

    def _wait_ready(self, timeout: float, exitcode, preload: TokenizerPreload | None = None) -> M.Ready:
        try:
            msg = self.recv(timeout)
        except EngineProcessDied as died:
            raise EngineStartupError(f"the engine process died during start-up (exit code {died.exitcode}); "
                                     "its output above says why") from None
        if isinstance(msg, M.StartupFailed):
            raise EngineStartupError(f"the engine process failed to start (exit code {exitcode()}): "
                                     f"{msg.error}\n{msg.traceback}")
        if msg is None:
            raise EngineStartupError(f"the engine process was not ready after {timeout:.0f} s")
        if not isinstance(msg, M.Ready):
            raise EngineStartupError(f"the engine process sent {type(msg).__name__} before it was ready")
        self.ready = msg
        path = msg.tokenizer_path
        self.tokenizer = preload.get(path) if preload is not None else load_tokenizer(Path(path) if path else None)
        return msg

    # --- talking to the engine ------------------------------------------------------------
    def send(self, msg: M.ToEngine, flags: int = 0) -> None:
        """Send a command (any thread; never blocks while the engine reads; `zmq.NOBLOCK`
        raises zmq.Again instead of waiting for an engine that no longer reads)."""
        data = self._encoder.encode(msg)
        with self._send_lock:
            if not self._closed:
                self._input.send(data, flags, copy=False)

    def _read(self):
        return self._decoder.decode(self._output.recv(copy=False).buffer)

    def recv(self, timeout: float | None = None) -> M.FromEngine | None:
        """The next message; None after `timeout` seconds; EngineProcessDied once the engine
        (or, for an attached client, the API process that owns it) has exited and every message
        it sent has been read. One reader thread only."""
        events = dict(self._poller.poll(None if timeout is None else int(timeout * 1000)))
        if self._output in events:
            return self._read()
        if self._watched_sentinel in events:
            # A message sent just before the exit may still be on its way through the socket.
            if self._output.poll(100):
                return self._read()
            raise EngineProcessDied(self._on_watched_exit())
        return None

    def _close_sockets(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._input.close()
        self._output.close()
        self._ctx.term()


def _engine_process(engine_args: dict, inputs: list[str], outputs: list[str]) -> None:
    """The engine process's entry point. The engine (and JAX) is imported there, not here: the API
    server processes never load it."""
    keep_torch_out()  # before transformers loads: the engine uses its configs and tokenizers only
    from mrv2_jax.engine.core_proc import run_engine_core

    run_engine_core(engine_args, inputs, outputs)


class CoreClient(_EngineLink):
    """Starts the engine process for `engine_args` (EngineConfig fields) and waits until it is
    ready; `ready` then says what the engine serves, and `tokenizer` is loaded here.
    `api_server_count` > 1 prepares endpoints for the other API processes (`attach_endpoints`)."""

    def __init__(self, engine_args: dict, startup_timeout: float = ENGINE_STARTUP_TIMEOUT,
                 api_server_count: int = 1):
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        if api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1, got {api_server_count}")
        self._dir = tempfile.mkdtemp(prefix="mrv2-engine-")
        inputs = [f"ipc://{self._dir}/input{i}" for i in range(api_server_count)]
        outputs = [f"ipc://{self._dir}/output{i}" for i in range(api_server_count)]
        # Per other API process: its endpoint pair on each engine (here one engine).
        self.attach_endpoints = [[pair] for pair in list(zip(inputs, outputs))[1:]]
        self._bind(inputs[0], outputs[0])
        # The attached clients hear of the engine's death from here (it is this process's child).
        self._notifiers = []
        for addr in outputs[1:]:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            self._notifiers.append(sock)
        self._shutdown_sent = False
        self.process = multiprocessing.get_context("spawn").Process(
            target=_engine_process, args=(dict(engine_args), inputs, outputs), name="mrv2-engine-core", daemon=True)
        self.process.start()
        preload = TokenizerPreload(_tokenizer_path(engine_args))  # loads while the engine starts
        self._watched_sentinel = self.process.sentinel
        self._poller.register(self.process.sentinel, zmq.POLLIN)
        try:
            deadline = time.monotonic() + startup_timeout
            self._wait_ready(startup_timeout, lambda: self._exitcode_by(deadline), preload)
        except BaseException:
            self.close(timeout=5.0)
            raise

    def _exitcode_by(self, deadline: float) -> int | None:
        self.process.join(max(1.0, deadline - time.monotonic()))
        return self.process.exitcode

    def _on_watched_exit(self) -> int | None:
        """The engine exited: tell the attached API processes; -> its exit code."""
        self.process.join(1.0)
        exitcode = self.process.exitcode
        died = self._encoder.encode(M.EngineDied(exitcode))
        with self._send_lock:
            for sock in self._notifiers:
                sock.send(died)
        return exitcode

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    def ask_to_stop(self) -> None:
        """Send the engine `Shutdown`, once: a second send could find the engine gone from the
        socket while its process still exits, and a PUSH with no peer blocks."""
        if not self._shutdown_sent and self.process.is_alive():
            self._shutdown_sent = True
            try:  # an engine that is exiting (after a failed step) has closed its end already
                self.send(M.Shutdown(), zmq.NOBLOCK)
            except zmq.Again:
                pass

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop, wait up to `timeout` s, then terminate (and kill) it."""
        if self.process.is_alive():
            self.ask_to_stop()
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5.0)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine and release the sockets (after the reader thread has finished)."""
        self.stop(timeout)
        with self._send_lock:
            for sock in self._notifiers:
                sock.close()
            self._notifiers = []
        self._close_sockets()
        shutil.rmtree(self._dir, ignore_errors=True)


class AttachedCoreClient(_EngineLink):
    """Another API process's handle on an engine that a `CoreClient` started: the endpoint pair
    `index` of its `attach_endpoints` (index >= 1). It neither starts nor stops the engine."""

    def __init__(self, index: int, input_addr: str, output_addr: str,
                 startup_timeout: float = ENGINE_STARTUP_TIMEOUT):
        self.index = index
        self._bind(input_addr, output_addr)
        owner = multiprocessing.parent_process()
        if owner is None:
            raise RuntimeError("an AttachedCoreClient runs in a process started by the engine's owner")
        self._owner = owner
        self._watched_sentinel = owner.sentinel
        self._poller.register(owner.sentinel, zmq.POLLIN)
        try:
            self._wait_ready(startup_timeout, lambda: None)
        except BaseException:
            self._close_sockets()
            raise

    def _on_watched_exit(self) -> None:
        return None  # the owner died: the engine (its child) goes with it; its exit code is not ours to see

    @property
    def is_alive(self) -> bool:
        return self._owner.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """The engine belongs to the owner: nothing to stop here."""

    def close(self, timeout: float = 30.0) -> None:
        self._close_sockets()
