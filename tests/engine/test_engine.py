"""The real engine (scheduler + KV manager + V1 runner + model) against a plain greedy loop."""

import numpy as np
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.models.paths import CHECKPOINTS_DIR
from mrv2_jax.sampling_params import SamplingParams
from tests.engine_reference import greedy_reference
from tests.parity import FIXTURES

MODEL = FIXTURES / "qwen3-tiny"  # vocab 96, eos 2
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_llm(model=str(MODEL), **overrides):
    args = dict(dtype="float32", runner="v1", max_num_seqs=8, max_num_batched_tokens=32,
                max_model_len=96, num_gpu_blocks=128, block_size=4, show_progress=False)
    return LLM(model, **(args | overrides))


def random_prompts(n, seed, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 96, k)] for k in rng.integers(lo, hi, n)]


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_batched_greedy_equals_one_at_a_time_loop(llm):
    prompts = random_prompts(32, seed=0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # input order kept
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == greedy_reference(MODEL, prompt, 8)
        assert out.outputs[0].finish_reason == "length"
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_preemption_keeps_outputs_and_frees_every_block():
    # 104 token slots for 12 requests; one bucket size (one program set to compile)
    llm = make_llm(num_gpu_blocks=26, max_model_len=96, bucket_token_sizes=(32,))
    prompts = random_prompts(12, seed=1, lo=20, hi=40)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == greedy_reference(MODEL, prompt, 16)
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_prefix_caching_hits_and_changes_nothing():
    rng = np.random.default_rng(2)
    context = [int(t) for t in rng.integers(3, 96, 37)]  # a long shared "document"
    prompts = [context + [int(t) for t in rng.integers(3, 96, k)] for k in (3, 5, 8, 2, 6, 4)]
    with_cache = make_llm(enable_prefix_caching=True, bucket_token_sizes=(32,))  # one program set to compile
    first = with_cache.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache
    rest = with_cache.generate(prompts[1:], GREEDY, use_tqdm=False)
    cached = first + rest
    assert sum(o.num_cached_tokens for o in rest) >= 5 * 36
    plain = make_llm(enable_prefix_caching=False, bucket_token_sizes=(32,)).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    for prompt, out in zip(prompts, cached):
        assert out.outputs[0].token_ids == greedy_reference(MODEL, prompt, 8)


def test_stop_token_and_max_tokens_are_exact(llm):
    prompt = random_prompts(1, seed=3, lo=10, hi=11)[0]
    expected = greedy_reference(MODEL, prompt, 12)
    stop_at = expected[5]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=[stop_at]), use_tqdm=False)[0]
    first = expected.index(stop_at)
    assert out.outputs[0].token_ids == expected[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[:3]


def test_abort_of_running_request_frees_its_blocks(llm):
    kv = llm.engine.scheduler.kv_cache_manager
    ids = llm._add_all(random_prompts(3, seed=4, lo=20, hi=30),
                       SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        llm.step()
    assert kv.num_free_blocks < kv.num_blocks
    llm.abort(ids)
    while llm.engine.has_work():
        llm.step()
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.engine.scheduler.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    prompt = random_prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(6, seed=6)
    batch = llm.generate(others[:3] + [prompt] + others[3:],
                         [SamplingParams(max_tokens=8, temperature=1.0, seed=i) for i in range(3)]
                         + [params] + [GREEDY] * 3, use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    greedy = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert alone != greedy  # temperature 1 on a random model really samples


def test_bad_requests_raise_and_leave_nothing_behind(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 10, [5] * 200], GREEDY, use_tqdm=False)
    assert not llm.engine.has_work()
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 96\)"):
        llm.generate([[5, 96]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(str(MODEL), no_such_arg=1)


def demo_llm() -> LLM:
    """The demo model (a real tokenizer) in the server tests' engine shape (tests/server_harness.py):
    its compiled steps load from the persistent compilation cache."""
    return LLM("demo", dtype="float32", runner="v2", max_num_seqs=16, max_num_batched_tokens=32,
               max_model_len=256, num_gpu_blocks=160, block_size=16, show_progress=False)


def test_stop_string_spanning_tokens_with_the_demo_model():
    """Text stops exactly before a stop string that does not sit on token boundaries."""
    llm = demo_llm()
    prompt = "The king said"
    full = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)[0].outputs[0]
    tokens = llm.tokenizer.convert_ids_to_tokens(full.token_ids)
    assert len(full.text) > 20 and len(tokens) > 5
    # A stop string that starts inside one token and ends inside a later one.
    start = len(llm.tokenizer.decode(full.token_ids[:3])) + 1
    stop = full.text[start : start + 6]
    assert stop.strip() and stop not in full.text[:start]
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].text == full.text[:start]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_generate_reports_only_final_outputs_and_matches_streamed_text():
    """`generate` detokenizes once per request at the end (no stop strings) or every step (stop
    strings): its text must equal the concatenated deltas of the same requests streamed."""
    llm = demo_llm()
    prompts = ["The king said", "O Romeo", "Good morrow, sir", "What"]
    params = [SamplingParams(max_tokens=n, temperature=0.9, seed=s) for n, s in [(25, 1), (7, 2), (40, 3), (1, 4)]]
    params.append(SamplingParams(max_tokens=30, temperature=0.8, seed=5, stop=["e t", "ng,"]))
    prompts.append("Now is the winter")
    streamed: dict[str, str] = {}
    finals = {}
    for out in llm.stream(prompts, params):
        streamed[out.request_id] = streamed.get(out.request_id, "") + out.delta_text
        if out.finished:
            finals[out.request_id] = out.outputs[0]
    ids = [llm.add_request(p, sp, final_only=True) for p, sp in zip(prompts, params)]
    reported = []
    while llm.engine.has_work():
        for out in llm.step():
            assert out.finished, "a final_only request was reported before it finished"
            reported.append(out)
    assert sorted(o.request_id for o in reported) == sorted(ids)
    by_id = {o.request_id: o.outputs[0] for o in reported}
    for stream_id, gen_id in zip(sorted(finals, key=int), ids):
        want, got = finals[stream_id], by_id[gen_id]
        assert got.token_ids == want.token_ids
        assert got.text == want.text == streamed[stream_id]
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    generated = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].text for g in generated] == [by_id[i].text for i in ids]


def test_unrolled_layer_loop_gives_the_same_tokens():
    prompts = random_prompts(6, seed=5)
    # One 8-token bucket (prompts prefill in chunks): the unrolled model compiles two programs.
    want = [o.outputs[0].token_ids for o in make_llm(runner="v2", max_num_batched_tokens=8).generate(
        prompts, GREEDY, use_tqdm=False)]
    # Its programs are this test's alone: greedy batches run the greedy sampler variant, a third of
    # `all`'s compile (the loop engine's `all` programs are shared with test_bench and test_prompt_logprobs).
    unrolled = make_llm(runner="v2", layer_unroll=0, max_num_batched_tokens=8, sampler_variants="greedy,all")
    got = [o.outputs[0].token_ids for o in unrolled.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    with pytest.raises(ValueError, match="layer_unroll"):
        make_llm(layer_unroll=-1)


def test_small_buckets_with_unrolled_layers_give_the_same_tokens():
    """unrolled_layers_max_tokens: the 8-token bucket's step program unrolls the layers (no loop in
    its HLO), the 16-token bucket's keeps the scan, and greedy tokens equal the looped engine's."""
    prompts = random_prompts(6, seed=5)
    want = [o.outputs[0].token_ids for o in make_llm(runner="v2", max_num_batched_tokens=8).generate(
        prompts, GREEDY, use_tqdm=False)]
    llm = make_llm(runner="v2", max_num_batched_tokens=16, unrolled_layers_max_tokens=8, max_fused_steps=1,
                   sampler_variants="greedy,all")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    runner = llm.engine.runner
    loops = {(b.num_tokens, "while" in programs[0].as_text()) for b, (_, programs) in runner.compiled.items()}
    assert loops == {(8, False), (16, True)}
    with pytest.raises(ValueError, match="unrolled_layers_max_tokens needs the v2 runner"):
        make_llm(runner="v1", unrolled_layers_max_tokens=8)


def test_fused_decode_of_a_small_bucket_unrolls_the_layers_too():
    """unrolled_layers_max_tokens covers fused decode's programs: the 8-row fused program keeps only
    its loop over steps (the looped engine's has the layer loop inside it), and greedy tokens of fused
    decode with the layers unrolled equal one step per call's with the loop."""
    prompts = random_prompts(6, seed=9)
    looped = make_llm(runner="v2", max_num_batched_tokens=16, max_fused_steps=1)
    want = [o.outputs[0].token_ids for o in looped.generate(prompts, GREEDY, use_tqdm=False)]
    whiles = {}
    for unrolled in (0, 8):
        llm = make_llm(runner="v2", max_num_batched_tokens=16, unrolled_layers_max_tokens=unrolled, max_fused_steps=4,
                       sampler_variants="greedy,all")
        ((bucket, (_, programs)),) = llm.engine.runner.fused.items()
        whiles[unrolled] = (bucket.num_tokens, programs[0].as_text().count(" while("))
    assert whiles == {0: (8, 2), 8: (8, 1)}
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert llm.engine.runner.num_fused_calls > 0  # the tokens came from fused calls


def test_fused_decode_of_one_row_pads_to_eight_tokens(monkeypatch):
    """A fused program takes one token per row, and one row pads to fused.ONE_ROW_TOKENS: one row's
    bucket (8 tokens, 1 row) runs its model on 1 real token and 7 padding ones (the projections stay
    GEMMs); greedy tokens equal one step per call's."""
    from mrv2_jax.runner import fused

    prompts = random_prompts(3, seed=13)
    want = [o.outputs[0].token_ids for o in make_llm(runner="v2", max_num_seqs=1, max_fused_steps=1).generate(
        prompts, GREEDY, use_tqdm=False)]
    tokens, forward = [], fused.forward_and_sample
    monkeypatch.setattr(fused, "forward_and_sample",
                        lambda *a, **kw: tokens.append(kw["input_ids"].shape[0]) or forward(*a, **kw))
    llm = make_llm(runner="v2", max_num_seqs=1, max_fused_steps=4)
    assert [(b.num_tokens, b.num_reqs) for b in llm.engine.runner.fused_buckets] == [(8, 1)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want and llm.engine.runner.num_fused_calls > 0
    assert tokens and set(tokens) == {fused.ONE_ROW_TOKENS} and fused.ONE_ROW_TOKENS > 1


def gemv_projections_against_gemms(monkeypatch, model, rows, max_fused_steps=4, num_prompts=3):
    """Greedy tokens of `model` (bf16, engines of `rows` rows and `max_fused_steps`, `num_prompts` prompts)
    with --kernels decode_projections=gemv against cuBLAS's GEMMs (one row padded to 8 tokens) ->
    (whether each projection handed on as a LayerWeight took the GEMV kernel, and per traced forward
    its program's kind ("fused" or "step"), token count and CausalLM.gemv_projections).

    Both must give the GEMM path's tokens up to the first step whose top two candidates are within a
    few bf16 steps of each other: the paths round differently, such a near-tie may go either way, and
    the sequences may part there."""
    from mrv2_jax.models import gemv_projections
    from mrv2_jax.models.layer_weight import LayerWeight
    from mrv2_jax.runner import fused, v2

    prompts = random_prompts(num_prompts, seed=13)
    # Lazy compiles (the CPU's default) on a GPU too: the reference engine's background compiles would
    # trace its programs after the spy below is in place. No program store (a GPU's default): a program
    # loaded from it is not traced, and the spy would see nothing.
    config = dict(model=model, runner="v2", dtype="bfloat16", max_num_seqs=rows, max_fused_steps=max_fused_steps,
                  compile_mode="lazy", program_store=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    # The reference names cuBLAS's GEMMs: "auto" is the GEMV path itself on Hopper-class GPUs.
    reference = [o.outputs[0] for o in make_llm(**config, kernels="decode_projections=xla")
                 .generate(prompts, params, use_tqdm=False)]
    calls = []
    for kind, module in (("fused", fused), ("step", v2)):
        def traced(lm, *a, kind=kind, forward=module.forward_and_sample, **kw):
            calls.append((kind, kw["input_ids"].shape[0], lm.gemv_projections))
            return forward(lm, *a, **kw)

        monkeypatch.setattr(module, "forward_and_sample", traced)
    kernel_calls, takes = [], gemv_projections._kernel_takes

    def spy(x, w):
        took = takes(x, w)
        if isinstance(w, LayerWeight):
            kernel_calls.append(took)
        return took

    monkeypatch.setattr(gemv_projections, "_kernel_takes", spy)
    llm = make_llm(**config, kernels="decode_projections=gemv")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    compared = 0
    for want, out in zip(reference, got):
        for step, (token, candidates) in enumerate(zip(want.token_ids, want.logprobs)):
            assert out[step] == token, (step, want.token_ids, out)
            compared += 1
            top = sorted((c.logprob for c in candidates.values()), reverse=True)
            if top[0] - top[1] < 0.25:  # a near-tie: what follows may part
                break
    assert compared >= 8 * num_prompts // 3  # most steps are clear
    return kernel_calls, calls


@pytest.mark.parametrize("rows", [1, 4])
def test_fused_decode_through_the_gemv_path(monkeypatch, rows):
    """--kernels decode_projections=gemv with the tiny model, whose shapes the GEMV kernel does not
    tile (K = 64): fused decode's one-row bucket computes one token with the GEMV weights handed on
    and the XLA math; four rows keep the GEMMs (the kernel in the engine is the GPU test below; on a
    CPU its interpreter takes minutes there, and tests/models/test_gemv_projections.py checks it in
    the layer)."""
    kernel_calls, calls = gemv_projections_against_gemms(monkeypatch, str(MODEL), rows)
    assert {call for call in calls if call[0] == "fused"} == {("fused", rows, rows == 1)}
    assert kernel_calls == ([False] * 4 if rows == 1 else [])


@pytest.mark.parametrize("rows", [1, 4])
def test_one_step_per_call_of_a_lone_row_takes_the_one_token_bucket(monkeypatch, rows):
    """Without fused decode, one request decoding alone (an engine of one row, or of four with one
    request in it) runs the one-token, one-row bucket's step program, its projections on the GEMV path;
    the prompt's step keeps the GEMMs."""
    kernel_calls, calls = gemv_projections_against_gemms(monkeypatch, str(MODEL), rows, max_fused_steps=1,
                                                         num_prompts=1)
    assert {call for call in calls if call[1] == 1} == {("step", 1, True)}
    assert all(kind == "step" and not gemv for kind, tokens, gemv in calls if tokens > 1) and len(calls) > 1
    assert kernel_calls == [False] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("max_fused_steps", [4, 1])
def test_one_row_through_the_gemv_kernels(monkeypatch, max_fused_steps):
    """The same with the demo model, whose projections the kernel tiles: all four take it, in fused
    decode's one-row program and in the one-token step program."""
    kernel_calls, calls = gemv_projections_against_gemms(monkeypatch, str(CHECKPOINTS_DIR / "demo-qwen3"), 1,
                                                         max_fused_steps=max_fused_steps, num_prompts=3)
    kind = "fused" if max_fused_steps > 1 else "step"
    assert (kind, 1, True) in calls  # the decode ran in that program
    assert kernel_calls == [True] * 4


def test_unrolled_layers_by_rows_add_buckets_of_few_rows():
    """unrolled_layers_max_rows: 8- and 16-token buckets of 4 rows are added and unroll; the buckets
    of 8 rows keep the loop; a step picks a few-row bucket when its rows fit; greedy tokens equal the
    looped engine's."""
    from mrv2_jax.runner.buckets import Bucket

    prompts = random_prompts(6, seed=7)
    want = [o.outputs[0].token_ids for o in make_llm(runner="v2", max_num_batched_tokens=16).generate(
        prompts, GREEDY, use_tqdm=False)]
    llm = make_llm(runner="v2", max_num_batched_tokens=16, unrolled_layers_max_tokens=16, unrolled_layers_max_rows=4,
                   max_fused_steps=1, sampler_variants="greedy,all")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    runner = llm.engine.runner
    assert runner.buckets.pick(12, 3) == Bucket(16, 4) and runner.buckets.pick(12, 6) == Bucket(16, 8)
    assert runner.buckets.pick(6, 3) == Bucket(8, 4)
    loops = {(b.num_tokens, b.num_reqs, "while" in programs[0].as_text())
             for b, (_, programs) in runner.compiled.items()}
    assert loops == {(8, 4, False), (8, 8, True), (16, 4, False), (16, 8, True)}
    with pytest.raises(ValueError, match="unrolled_layers_max_rows must be an int >= 1"):
        make_llm(runner="v2", unrolled_layers_max_rows=0)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_warm_up_runs_every_program_once_and_changes_no_output(runner):
    """Runner.warm_up runs each step program (every bucket, sampler variant and fused decode bucket)
    once on an empty batch; greedy and seeded outputs afterwards equal an engine's that did not warm up."""
    prompts = random_prompts(5, seed=11)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    params = [GREEDY, seeded, GREEDY, seeded, GREEDY]
    config = dict(runner=runner, max_num_batched_tokens=8, sampler_variants="greedy,all", compile_mode="eager")
    want = [o.outputs[0].token_ids for o in make_llm(**config).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(**config)
    runner_ = llm.engine.runner
    ran, call_step = [], runner_.call_step
    runner_.call_step = lambda compiled, packed: ran.append(compiled) or call_step(compiled, packed)
    runner_.warm_up()
    programs = [p for _, variants in runner_._step_programs.values() for p in variants]
    assert len(programs) == len(runner_.buckets) * 2 + (len(runner_.fused_buckets) * 2 if runner == "v2" else 0)
    assert sorted(map(id, ran)) == sorted(map(id, programs))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_unrolled_small_buckets_default_on_one_gpu_only(monkeypatch):
    """The default (None) unrolls buckets of up to DEFAULT_UNROLLED_LAYERS_MAX_TOKENS tokens on a GPU
    with the v2 runner, one device and no speculative decoding; 0 on the CPU and elsewhere; a set
    value always wins."""
    import jax

    from mrv2_jax.engine.builder import resolve_unrolled_layers_max_tokens
    from mrv2_jax.engine.engine_config import DEFAULT_UNROLLED_LAYERS_MAX_TOKENS, EngineConfig

    demo = dict(model="demo", dtype="float32")
    assert resolve_unrolled_layers_max_tokens(EngineConfig(runner="v2", **demo)) == 0  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_unrolled_layers_max_tokens(EngineConfig(runner="v2", **demo)) == DEFAULT_UNROLLED_LAYERS_MAX_TOKENS
    assert resolve_unrolled_layers_max_tokens(EngineConfig(runner="v1", **demo)) == 0
    assert resolve_unrolled_layers_max_tokens(EngineConfig(runner="v2", tensor_parallel_size=2, **demo)) == 0
    spec = {"method": "draft_model", "k": 2, "model": "demo"}
    assert resolve_unrolled_layers_max_tokens(EngineConfig(runner="v2", speculative_config=spec, **demo)) == 0
    assert resolve_unrolled_layers_max_tokens(EngineConfig(runner="v2", unrolled_layers_max_tokens=64, **demo)) == 64


def test_engine_compiles_in_the_background_and_warms_up_on_gpus(monkeypatch):
    """GPUs: compile mode background by default, and a warm-up of the programs ready at start-up
    in eager and background mode; CPUs: lazy, no warm-up."""
    import jax

    from mrv2_jax.engine.builder import resolve_compile_mode, warms_up
    from mrv2_jax.engine.engine_config import EngineConfig

    demo = dict(model="demo", dtype="float32")
    assert resolve_compile_mode(None) == "lazy" and not warms_up(EngineConfig(**demo))  # this CPU
    assert not warms_up(EngineConfig(compile_mode="eager", **demo))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_compile_mode(None) == "background" and resolve_compile_mode("eager") == "eager"
    assert warms_up(EngineConfig(**demo)) and warms_up(EngineConfig(compile_mode="eager", **demo))
    assert warms_up(EngineConfig(compile_mode="background", **demo))
    assert not warms_up(EngineConfig(compile_mode="lazy", **demo))


def test_a_tokenizer_path_without_a_tokenizer_is_refused(tmp_path):
    """An explicit --tokenizer that holds none fails at start, instead of a server that takes no text."""
    with pytest.raises(ValueError, match="holds no Hugging Face tokenizer"):
        make_llm(tokenizer=str(tmp_path / "missing"))


def test_named_bucket_size_pads_every_step_and_keeps_the_tokens():
    """`bucket_token_sizes`: the plan holds only the size named, and every step (chunked prefill
    and decode) padded to it gives the plain loop's tokens."""
    llm = make_llm(runner="v2", bucket_token_sizes=(32,), max_fused_steps=1, sampler_variants="greedy,all")
    assert {b.num_tokens for b in llm.engine.runner.buckets} == {32}
    prompts = random_prompts(6, seed=5, lo=20, hi=60)  # longer than 32 tokens: chunked
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.outputs[0].token_ids == greedy_reference(MODEL, prompt, 8)
