"""The engine core in a process of its own: schedule -> runner -> outputs, and nothing else.

The API server process (mrv2_jax/core_client.py) starts this with the `spawn` method (JAX is
not fork-safe) and talks to it over ZMQ sockets with msgpack messages (core_messages.py): one
input socket that reads the commands of every API server process (`--api-server-count`), and one
output socket per API server process, which gets the outputs of the requests it sent. The loop:

    poll the input socket (and the parent's liveness): without waiting while there is work,
        blocking while idle
    apply every queued command: add / abort / finish (stop strings) / shutdown
    step() once, and send that step's outputs, the failed adds and the counters as ONE message

A request whose structured-output constraint is not compiled yet waits beside the loop until a
background thread has compiled it (background_compiles.py), so running requests never wait.

The process exits when told to, when its parent dies (no orphan engine holding the device), or
after a step raises (it reports the error first: the scheduler and device state may disagree).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from mrv2_jax.engine import core_messages as M
from mrv2_jax.engine.background_compiles import POLL_S, BackgroundCompiles
from mrv2_jax.engine.builder import build_engine
from mrv2_jax.engine.engine_config import EngineConfig
from mrv2_jax.engine.engine_core import EngineCore
from mrv2_jax.engine.hand_over import Dispatch
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.request_checks import check_request_fits
from mrv2_jax.gc_heap import prepare_serving_heap

# A message the engine sent just before it exits still reaches the API process.
_LINGER_MS = 5000


def run_engine_core(engine_args: dict, input_addrs: list[str], output_addrs: list[str]) -> None:
    """The process's entry point: build the engine, report ready (or why not), serve commands.
    `input_addrs` / `output_addrs`: one of each per API server process, in client-index order."""
    # Ctrl-C in a terminal reaches the whole process group; the API server decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    outs = []
    for addr in output_addrs:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, _LINGER_MS)
        out.connect(addr)
        outs.append(out)
    inp = ctx.socket(zmq.PULL)  # fair-queues the commands of every API server process
    inp.setsockopt(zmq.LINGER, 0)
    for addr in input_addrs:
        inp.connect(addr)
    encoder = M.encoder()

    def send_all(msg) -> None:
        data = encoder.encode(msg)
        for out in outs:
            out.send(data)

    try:
        engine, tokenizer_path, model_state = build_engine(EngineConfig(**engine_args))
    except BaseException as exc:  # noqa: BLE001 - every start-up failure is reported the same way
        send_all(M.StartupFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        code = 1
    else:
        # Tokens streamed from inside fused calls go out on sockets of their own: they are sent
        # from XLA's callback thread, and a ZMQ socket belongs to one thread.
        stream_outs = []
        if engine.runner.stream_in_call:
            for addr in output_addrs:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(addr)
                stream_outs.append(sock)
        proc = EngineCoreProc(engine, model_state, inp, outs, stream_outs)
        frozen = prepare_serving_heap()
        send_all(M.Ready(
            pid=os.getpid(), tokenizer_path=None if tokenizer_path is None else str(tokenizer_path),
            max_model_len=engine.scheduler.max_model_len, vocab_size=model_state.vocab_size,
            num_eos=len(model_state.eos_token_ids or ()),
            supports_prompt_logprobs=engine.runner.supports_prompt_logprobs, stats=proc.stats(),
            eos_token_ids=list(model_state.eos_token_ids or ()),
            automaton_capacity=tuple(engine.runner.automaton_capacity),
            startup=engine.startup.as_dict() | {"gc_frozen_objects": frozen, "gc_thresholds": gc.get_threshold()}))
        code = proc.run()
        proc.close_streams()
    inp.close()
    for out in outs:
        out.close()
    ctx.term()
    sys.exit(code)


class EngineCoreProc:
    """The command / step loop around one `EngineCore` (see the module docstring)."""

    def __init__(self, engine: EngineCore, model_state, inp: zmq.Socket, outs: list[zmq.Socket],
                 stream_outs: list[zmq.Socket] = ()):
        self.engine = engine
        self.vocab_size = model_state.vocab_size
        self.num_eos = len(model_state.eos_token_ids or ())
        self.inp, self.outs = inp, outs
        # With several API server processes: which one sent each running request.
        self._owner: dict[str, int] = {}
        self.encoder = M.encoder()
        self.decoder = M.to_engine_decoder()
        self.num_steps = 0
        self.num_dropped_messages = 0  # step messages to another API process whose queue was full
        self._errors: list[tuple[str, str]] = []
        self._last_step_sent: float | None = None  # while requests ran after it: when that step's message left
        self._compiles = BackgroundCompiles(engine.compiler)
        self._stream_outs = list(stream_outs)
        self._stream_lock = threading.Lock()  # XLA may call back from more than one thread
        self._stream_encoder = M.encoder()
        if self._stream_outs:
            engine.attach_token_sink(self._send_streamed)

    def run(self) -> int:
        """Serve until told to stop (0), the parent died (0) or a step or command failed (1,
        after telling the API process why: the scheduler and device state may disagree now)."""
        try:
            return self._loop()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, this engine is done
            data = self.encoder.encode(M.EngineFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            for out in self.outs:
                out.send(data)
            return 1

    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)
        engine = self.engine
        while True:
            timeout = 0 if engine.has_work() else POLL_S * 1000 if self._compiles else None
            events = dict(poller.poll(timeout))
            if parent is not None and parent.sentinel in events:
                return 0  # nobody is left to read our outputs
            changed = False
            if self.inp in events:
                if not self._apply_commands():
                    return 0
                changed = True
            for cmd, error in self._compiles.done():  # constraints compiled beside the loop
                if error is None:
                    self._add(cmd)
                else:
                    self._errors.append((cmd.request_id, str(error)))
                changed = True
            if engine.has_work():
                outputs = engine.step()
                self.num_steps += 1
                self._send(outputs, engine.outputs_prefill_tokens, engine.dispatched, step=True)
            elif changed:
                self._send([])  # e.g. an abort while idle: the freed blocks show in the counters

    def _apply_commands(self) -> bool:
        """Apply every command waiting on the socket; False on shutdown."""
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            cmd = self.decoder.decode(frame.buffer)
            if isinstance(cmd, M.AddRequest):
                if len(self.outs) > 1:
                    self._owner[cmd.request_id] = cmd.client_index
                if self._compiles.needs_compile(cmd.params):
                    self._compiles.submit(cmd)
                else:
                    self._add(cmd)
            elif isinstance(cmd, M.AbortRequests):
                self._compiles.abort(cmd.request_ids)
                self.engine.abort_requests(cmd.request_ids)
                self._forget(cmd.request_ids)
            elif isinstance(cmd, M.FinishRequests):
                self.engine.finish_requests(cmd.request_ids)
                self._forget(cmd.request_ids)
            elif isinstance(cmd, M.Shutdown):
                return False

    def _add(self, cmd: M.AddRequest) -> None:
        try:
            check_request_fits(cmd.params, self.vocab_size, num_eos=self.num_eos)
            self.engine.add_request(Request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                            streaming=cmd.streaming))
        except Exception as exc:  # this request is bad: tell its caller, keep serving the rest
            self._errors.append((cmd.request_id, str(exc)))

    def _forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._owner.pop(request_id, None)

    def _send(self, outputs, prefill_tokens: int = 0, dispatched: Dispatch | None = None,
              step: bool = False) -> None:
        """One message per API server process: its requests' outputs and failed adds, the prompt
        tokens of the step whose outputs these are, the hand-over of the step dispatched in the same
        iteration (EngineCore.dispatched), when it left and how long after the previous step's (`step`:
        these are a step's outputs), and the counters (every process serves /metrics and /health)."""
        errors, self._errors = self._errors, []
        stats = self.stats()
        dispatch = Dispatch(-1.0, 0, -1.0, -1.0) if dispatched is None else dispatched
        sent_at = time.monotonic()
        since = sent_at - self._last_step_sent if step and self._last_step_sent is not None else -1.0
        self._last_step_sent = sent_at if step and self.engine.has_work() else None

        def message(client_outputs, client_errors):
            return self.encoder.encode(M.StepOutputs(client_outputs, client_errors, stats, prefill_tokens,
                                                     dispatch.seconds, dispatch.prefill_tokens, sent_at, since,
                                                     dispatch.cpu_s, dispatch.call_s))

        if len(self.outs) == 1:
            self.outs[0].send(message(outputs, errors), copy=False)
            return
        # A request this process no longer knows (aborted, or finished by a stop string one step
        # before this late output) has nobody waiting for it: its output is dropped.
        per_client = [([], []) for _ in self.outs]
        for out in outputs:
            owner = self._owner.pop(out.req_id, None) if out.finished else self._owner.get(out.req_id)
            if owner is not None:
                per_client[owner][0].append(out)
        for request_id, why in errors:
            owner = self._owner.pop(request_id, None)
            if owner is not None:
                per_client[owner][1].append((request_id, why))
        for index, (sock, (client_outputs, client_errors)) in enumerate(zip(self.outs, per_client)):
            data = message(client_outputs, client_errors)
            if index == 0:  # the process that owns this engine
                sock.send(data, copy=False)
                continue
            try:  # an API process that died stops the server soon; until then the engine must not block on it
                sock.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.num_dropped_messages += 1

    def _send_streamed(self, entries) -> None:
        """A fused step's tokens to the API processes of their requests (XLA's callback thread).
        Never blocks: a token that does not go out now still comes in the call's StepOutputs."""
        with self._stream_lock:
            if len(self._stream_outs) == 1:
                per_client = [entries]
            else:
                per_client = [[] for _ in self._stream_outs]
                for entry in entries:
                    owner = self._owner.get(entry[0])
                    if owner is not None:
                        per_client[owner].append(entry)
            for sock, client_entries in zip(self._stream_outs, per_client):
                if client_entries:
                    try:
                        sock.send(self._stream_encoder.encode(M.StreamedTokens(client_entries)), zmq.NOBLOCK)
                    except zmq.Again:
                        pass

    def close_streams(self) -> None:
        """Stop streaming from fused calls. A call still in flight finishes first: its callbacks
        need this interpreter, which must not be finalizing under them."""
        if not self._stream_outs:
            return
        self.engine.attach_token_sink(None)
        import jax

        try:
            jax.effects_barrier()
        finally:
            with self._stream_lock:
                for sock in self._stream_outs:
                    sock.close()
                self._stream_outs = []

    def stats(self) -> M.CoreStats:
        scheduler = self.engine.scheduler
        s = scheduler.get_stats()
        kv = scheduler.kv_cache_manager
        spec = None if s.spec_decode is None else vars(s.spec_decode)
        return M.CoreStats(
            num_running_reqs=s.num_running_reqs, num_waiting_reqs=s.num_waiting_reqs,
            num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_blocks, kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, num_steps=self.num_steps,
            num_fused_calls=self.engine.runner.num_fused_calls, spec_decode=spec,
            num_programs_pending=self.engine.runner.num_programs_pending)
