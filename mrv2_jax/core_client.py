"""The API server's handle on the engine-core process (engine/core_proc.py): start it, wait for
it to be ready, send it commands, receive its per-step messages, notice when it dies, stop it.

The process is started with the `spawn` method (JAX is not fork-safe) and inherits this
process's environment (XLA_FLAGS, MRV2_COMPILATION_CACHE, ...). Two ZMQ sockets over ipc:// in
a private temporary directory: commands out (PUSH, any thread, serialised by a lock) and step
messages in (PULL, one reader thread). Death is seen at once: `recv` polls the process's
sentinel beside the socket, so a killed engine is noticed without any timeout.
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
from mrv2_jax.engine.builder import EngineConfig, load_tokenizer
from mrv2_jax.engine.core_proc import run_engine_core


class EngineStartupError(RuntimeError):
    """The engine process did not become ready (it failed, died, or took too long)."""


class EngineProcessDied(RuntimeError):
    """The engine process has exited."""

    def __init__(self, exitcode: int | None):
        super().__init__(f"the engine process exited (exit code {exitcode})")
        self.exitcode = exitcode


class CoreClient:
    """Starts the engine process for `engine_args` (EngineConfig fields) and waits until it is
    ready; `ready` then says what the engine serves, and `tokenizer` is loaded here."""

    def __init__(self, engine_args: dict, startup_timeout: float = ENGINE_STARTUP_TIMEOUT):
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self._dir = tempfile.mkdtemp(prefix="mrv2-engine-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block a sender; a dead engine is refused earlier
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        self._encoder = M.encoder()
        self._decoder = M.from_engine_decoder()
        # Re-entrant: a stream dropped during a send may abort its request (garbage collection).
        self._send_lock = threading.RLock()
        self._closed = False
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(dict(engine_args), input_addr, output_addr),
            name="mrv2-engine-core", daemon=True)
        self.process.start()
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self.process.sentinel, zmq.POLLIN)
        try:
            self.ready = self._wait_ready(startup_timeout)
            self.tokenizer = load_tokenizer(Path(self.ready.tokenizer_path)) if self.ready.tokenizer_path else None
        except BaseException:
            self.close(timeout=5.0)
            raise

    def _wait_ready(self, timeout: float) -> M.Ready:
        deadline = time.monotonic() + timeout
        try:
            msg = self.recv(timeout)
        except EngineProcessDied as died:
            raise EngineStartupError(f"the engine process died during start-up (exit code {died.exitcode}); "
                                     "its output above says why") from None
        if isinstance(msg, M.StartupFailed):
            self.process.join(max(1.0, deadline - time.monotonic()))
            raise EngineStartupError(f"the engine process failed to start (exit code {self.process.exitcode}): "
                                     f"{msg.error}\n{msg.traceback}")
        if msg is None:
            raise EngineStartupError(f"the engine process was not ready after {timeout:.0f} s")
        if not isinstance(msg, M.Ready):
            raise EngineStartupError(f"the engine process sent {type(msg).__name__} before it was ready")
        return msg

    # --- talking to the engine ------------------------------------------------------------
    def send(self, msg: M.ToEngine) -> None:
        """Send a command (any thread; never blocks)."""
        data = self._encoder.encode(msg)
        with self._send_lock:
            if not self._closed:
                self._input.send(data, copy=False)

    def recv(self, timeout: float | None = None) -> M.FromEngine | None:
        """The next message; None after `timeout` seconds; EngineProcessDied once the process
        has exited and every message it sent has been read. One reader thread only."""
        events = dict(self._poller.poll(None if timeout is None else int(timeout * 1000)))
        if self._output in events:
            return self._decoder.decode(self._output.recv(copy=False).buffer)
        if self.process.sentinel in events:
            # A message sent just before the exit may still be on its way through the socket.
            if self._output.poll(100):
                return self._decoder.decode(self._output.recv(copy=False).buffer)
            self.process.join(1.0)
            raise EngineProcessDied(self.process.exitcode)
        return None

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop, wait up to `timeout` s, then terminate (and kill) it."""
        if self.process.is_alive():
            self.send(M.Shutdown())
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
            if self._closed:
                return
            self._closed = True
            self._input.close()
        self._output.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
