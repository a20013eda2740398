"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

import itertools
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from mrv2_jax.engine.builder import build_engine, resolve_compile_mode, warms_up
from mrv2_jax.engine.engine_config import EngineConfig
from mrv2_jax.engine.output import RequestOutput
from mrv2_jax.engine.output_processor import OutputProcessor
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.request_checks import check_request_fits
from mrv2_jax.gc_heap import relaxed_collection
from mrv2_jax.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model and generate. Engine arguments are the fields of `EngineConfig`
    (runner, max_num_seqs, max_num_batched_tokens, max_model_len, block_size, ...)."""

    def __init__(self, model: str | None = None, *, loaded_model=None, **engine_args):
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, **engine_args)
        self.engine, _, self.model_state = build_engine(self.config, loaded_model)
        # The engine's constraint compiler loads the tokenizer on first use; taking it from there
        # loads it once for both (the compiler exists whenever the model has a tokenizer).
        self.tokenizer = None if self.engine.compiler is None else self.engine.compiler.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # --- requests -----------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = [int(t) for t in prompt]
        vocab = self.model_state.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        return None, token_ids

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    final_only: bool = False, streaming: bool = False) -> str:
        """Queue one request; `final_only`: `step()` reports it only when it has finished;
        `streaming`: a client reads it as it goes (fused decode is capped by the stream interval)."""
        text, token_ids = self._tokenize(prompt)
        check_request_fits(params, self.model_state.vocab_size,
                           num_eos=len(self.model_state.eos_token_ids or ()))
        request = Request(request_id or str(next(self._ids)), token_ids, params, prompt=text, streaming=streaming)
        self.engine.add_request(request)  # validates lengths; raises before anything is tracked
        self.output_processor.add(request, final_only=final_only)
        return request.request_id

    def abort(self, request_ids: Sequence[str]) -> None:
        self.engine.abort_requests(request_ids)
        self.output_processor.remove(request_ids)

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Block until every planned step program is compiled (compile mode background compiles
        them beside the engine; other modes return at once), then, on GPUs, run them once as
        start-up does with the ones it had (Runner.warm_up), so that timed steps neither share the
        host with a compile nor record command buffers. Only while no request runs.
        -> False if `timeout` seconds passed first."""
        if self.engine.has_work():
            raise RuntimeError("wait_for_compiles: requests are running; call it before adding any")
        if not self.engine.runner.wait_for_compiles(timeout):
            return False
        if warms_up(self.config) and resolve_compile_mode(self.config.compile_mode) == "background":
            self.engine.runner.warm_up()
        return True

    # --- running ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(self.engine.step())
        if stopped:
            self.engine.finish_requests(stopped)
        return outputs

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               ) -> Iterator[RequestOutput]:
        """Yield a `RequestOutput` every time a request gets new tokens (`delta_text` holds the
        new text); the last one for each request has `finished=True`."""
        yield from self._run(self._add_all(prompts, sampling_params))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        ids = self._add_all(prompts, sampling_params, final_only=True)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            for out in self._run(ids):
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        return [final[i] for i in ids]

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        with relaxed_collection():  # no collection in nearly every step (gc_heap.py)
            while pending:
                for out in self.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
                if pending and not self.engine.has_work():
                    raise RuntimeError(f"engine went idle with {len(pending)} request(s) unfinished")

    def _add_all(self, prompts, sampling_params, final_only: bool = False) -> list[str]:
        """Add a batch of requests: all of them, or (on a bad one) none."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        added = []
        try:
            for prompt, sp in zip(prompts, params):
                added.append(self.add_request(prompt, sp, final_only=final_only))
        except Exception:
            self.abort(added)
            raise
        return added
