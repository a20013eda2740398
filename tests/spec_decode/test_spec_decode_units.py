"""Speculative decoding, the pure parts: rejection rules, the n-gram proposer, the config, the
scheduler's accounting. (Engine-level equivalence: test_spec_decode.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.config import CacheConfig, SchedulerConfig
from mrv2_jax.engine.request import Request
from mrv2_jax.engine.scheduler import Scheduler
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.spec_decode import rejection
from mrv2_jax.spec_decode.config import SpeculativeConfig
from mrv2_jax.spec_decode.ngram import ngram_drafts, ngram_drafts_one
from mrv2_jax.spec_decode.verify import verify_indices

# The code under test jitted and its inputs made with numpy: run op by op, each op would compile a small
# XLA program of its own.
_probabilistic = jax.jit(rejection.probabilistic)
_strict = jax.jit(rejection.strict)
_synthetic = jax.jit(rejection.synthetic)
_verify_indices = jax.jit(verify_indices, static_argnums=2)
_ngram_drafts = jax.jit(ngram_drafts, static_argnums=(2, 3, 4))

# --- rejection ----------------------------------------------------------------------------------

V = 6
P = np.array([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])  # target
Q = np.array([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])  # a poor draft


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


def first_token_counts(draft_probs, num_draws=20000, seed=0):
    """The first emitted token of rows with one draft sampled from q, verified against p."""
    rng = np.random.default_rng(seed)
    q = np.broadcast_to(draft_probs, (num_draws, V))
    drafts = np.array([rng.choice(V, p=row) for row in q[:64]] + list(rng.choice(V, num_draws - 64, p=draft_probs)))
    target_probs = np.broadcast_to(P.astype(np.float32), (num_draws, 2, V))
    # The target's own picks (index 1 is the bonus position); only index 0's fate matters here.
    target_tokens = rng.choice(V, (num_draws, 2), p=P).astype(np.int32)
    tokens, accepted = _probabilistic(
        target_tokens, target_probs, drafts[:, None].astype(np.int32), q[:, None, :].astype(np.float32),
        np.ones(num_draws, np.int32), np.arange(num_draws, dtype=np.int32), np.full((num_draws, 2), 17, np.int32))
    return np.bincount(np.asarray(tokens)[:, 0], minlength=V), np.asarray(accepted)


def test_probabilistic_rejection_preserves_the_target_distribution():
    counts, accepted = first_token_counts(Q)
    # 5 degrees of freedom: the 99.9% quantile is 20.5.
    assert chi_square(counts, P) < 20.5, counts
    # And the acceptance rate is sum(min(p, q)), as the theory says.
    assert abs(accepted.mean() - np.minimum(P, Q).sum()) < 0.02
    # A draft that IS the target is always accepted.
    _, accepted = first_token_counts(P, num_draws=4000)
    assert accepted.mean() == 1.0


def test_probabilistic_rejection_with_one_hot_drafts():
    rng = np.random.default_rng(1)
    n = 20000
    drafts = np.full((n, 1), 3, np.int32)  # an n-gram proposer keeps drafting token 3
    tokens, accepted = _probabilistic(
        rng.choice(V, (n, 2), p=P).astype(np.int32), np.broadcast_to(P.astype(np.float32), (n, 2, V)),
        drafts, None, np.ones(n, np.int32), np.arange(n, dtype=np.int32), np.full((n, 2), 5, np.int32))
    counts = np.bincount(np.asarray(tokens)[:, 0], minlength=V)
    assert chi_square(counts, P) < 20.5, counts
    assert abs(np.asarray(accepted).mean() - P[3]) < 0.02


def test_strict_and_synthetic_rules():
    target = jnp.array([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]], jnp.int32)
    drafts = jnp.array([[5, 6, 9], [5, 6, 7], [1, 2, 3]], jnp.int32)
    tokens, accepted = _strict(target, drafts, jnp.array([3, 3, 1], jnp.int32))
    assert accepted.tolist() == [2, 3, 1]
    assert tokens.tolist() == target.tolist()
    n = 4000
    rate = 0.7
    _, accepted = _synthetic(np.zeros((n, 4), np.int32), np.ones((n, 3), np.int32), np.full(n, 3, np.int32),
                             np.arange(n, dtype=np.int32), np.broadcast_to(np.arange(9, 13, dtype=np.int32), (n, 4)),
                             rate)
    mean = np.asarray(accepted).mean()
    assert abs(mean - (rate + rate**2 + rate**3)) < 0.08


def test_verify_indices():
    qsl = jnp.array([0, 4, 5, 9], jnp.int32)  # rows of 4, 1 and 4 tokens
    index = _verify_indices(qsl, jnp.array([3, 0, 2], jnp.int32), 3)
    assert index.tolist() == [[0, 1, 2, 3], [4, 4, 4, 4], [6, 7, 8, 8]]


# --- n-gram proposer ------------------------------------------------------------------------------

def test_ngram_on_device_matches_the_plain_rule():
    rng = np.random.default_rng(0)
    rows, lengths = [], []
    for i in range(40):
        n = int(rng.integers(1, 30))
        vocab = 3 if i % 2 else 8  # small vocabularies repeat often
        rows.append(np.concatenate([rng.integers(0, vocab, n), rng.integers(50, 60, 40 - n)]))
        lengths.append(n)
    rows = np.stack(rows).astype(np.int32)
    for k, lo, hi in [(3, 1, 3), (5, 2, 4), (1, 2, 2)]:
        got = np.asarray(_ngram_drafts(rows, np.asarray(lengths, np.int32), k, lo, hi))
        want = np.stack([ngram_drafts_one(r[:n], k, lo, hi) for r, n in zip(rows, lengths)])
        np.testing.assert_array_equal(got, want)
    # A loop: the continuation repeats with the loop's period.
    assert ngram_drafts_one([7, 1, 2, 3, 1, 2, 3, 1, 2], 5, 2, 3).tolist() == [3, 1, 2, 3, 1]


# --- configuration --------------------------------------------------------------------------------

def test_speculative_config_parsing_and_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "k": 3, "ngram_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max) == ("ngram", 3, 5)
    assert SpeculativeConfig.parse(None) is None
    bad = [({"method": "eagle", "k": 1}, "method"), ({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "k": 0}, "num_speculative_tokens"), ({"method": "draft_model", "k": 2}, "model"),
           ({"method": "synthetic", "k": 2}, "acceptance_rate"), ({"method": "ngram", "k": 2, "foo": 1}, "foo"),
           ({"method": "ngram", "k": 2, "rejection_sampling": "x"}, "rejection_sampling"),
           ({"method": "ngram", "k": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
           ("{not json", "JSON")]
    for value, word in bad:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.parse(value)


def test_mtp_without_an_mtp_layer_names_the_family():
    from mrv2_jax.models.loader import load_hf_config, resolve_model_path
    from mrv2_jax.models.model_state import model_state_for
    from mrv2_jax.spec_decode.mtp import build_mtp_proposer

    state = model_state_for(load_hf_config(resolve_model_path("demo")))
    with pytest.raises(NotImplementedError, match="Qwen3ForCausalLM"):
        build_mtp_proposer(state, None, 2)


# --- scheduler accounting -------------------------------------------------------------------------

def make_scheduler(k=3, lookahead=0):
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                     num_speculative_tokens=k, num_lookahead_tokens=lookahead),
                     CacheConfig(block_size=4, num_gpu_blocks=64), eos_token_id=None)


def test_scheduler_schedules_drafts_and_takes_back_rejected_ones():
    s = make_scheduler()
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0))
    s.add_request(req)
    out = s.schedule()  # prefill: no drafts
    assert out.num_scheduled_tokens == {"a": 3} and not out.num_spec_tokens
    s.update_from_output(out, {"a": [8]})
    out = s.schedule()  # decode: last token + 3 drafts
    assert out.num_scheduled_tokens == {"a": 4} and out.num_spec_tokens == {"a": 3}
    assert req.num_computed_tokens == 7 and req.num_output_placeholders == 4
    # Async: the next step is scheduled before the results arrive.
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"a": 4}
    s.update_from_output(out, {"a": [9, 10]})  # one draft accepted, two rejected
    assert req.output_token_ids == [8, 9, 10] and req.num_computed_tokens == 11 - 2
    assert req.num_output_placeholders == 4
    outs = s.update_from_output(out2, {"a": [11, 12, 13, 14]})  # all accepted
    assert outs[0].new_token_ids == [11, 12, 13, 14] and req.num_computed_tokens == 9
    assert req.num_tokens == 10 and req.num_output_placeholders == 0
    stats = s.get_stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.accepted_per_position == [2, 1, 1] and stats.mean_acceptance_length == 3.0
    # Near max_tokens, fewer drafts (3 outputs left of 10: the last token + 2 drafts).
    out = s.schedule()
    assert out.num_spec_tokens == {"a": 2}
    outs = s.update_from_output(out, {"a": [15, 16, 17]})
    assert outs[0].finish_reason == "length" and req.num_output_tokens == 10


def test_scheduler_gives_no_drafts_to_penalty_or_logprob_requests_and_stops_mid_row():
    s = make_scheduler(lookahead=3)
    s.add_request(Request("p", [1, 2], SamplingParams(max_tokens=8, repetition_penalty=1.2)))
    s.add_request(Request("s", [1, 2], SamplingParams(max_tokens=8, stop_token_ids=[42])))
    out = s.schedule()
    s.update_from_output(out, {"p": [3], "s": [3]})
    out = s.schedule()
    assert out.num_spec_tokens == {"s": 3} and out.num_scheduled_tokens == {"p": 1, "s": 4}
    # The lookahead keeps KV for the draft's own positions: 3 known + 3 drafts + 3 ahead.
    assert len(s.kv_cache_manager.get_block_ids("s")) == 3
    outs = {o.req_id: o for o in s.update_from_output(out, {"p": [4], "s": [42, 7, 8]})}
    assert outs["s"].new_token_ids == [42] and outs["s"].finish_reason == "stop"


# --- CLI and metrics ------------------------------------------------------------------------------

def test_cli_speculative_config_reaches_the_engine_config():
    import argparse

    from mrv2_jax.engine.engine_config import EngineConfig
    from mrv2_jax.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert EngineConfig(**engine_kwargs(args)).speculative_config.k == 2
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        EngineConfig(speculative_config="{")



def test_speculative_decoding_turns_fused_decode_off():
    """Spec decode and fused decode never run together: with a speculative_config,
    max_fused_steps defaults to 1 and an explicit K > 1 is refused (engine and scheduler)."""
    from mrv2_jax.engine.engine_config import DEFAULT_MAX_FUSED_STEPS, EngineConfig

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(runner="v2").max_fused_steps == DEFAULT_MAX_FUSED_STEPS
    assert EngineConfig(runner="v2", speculative_config=spec).max_fused_steps == 1
    assert EngineConfig(runner="v2", speculative_config=spec, max_fused_steps=1).max_fused_steps == 1
    with pytest.raises(ValueError, match="max_fused_steps=4 with speculative_config"):
        EngineConfig(runner="v2", speculative_config=spec, max_fused_steps=4)
    with pytest.raises(ValueError, match="requires max_fused_steps=1"):
        SchedulerConfig(max_model_len=64, num_speculative_tokens=2, max_fused_steps=4, max_fused_rows=8)

def test_spec_decode_metrics_on_the_metrics_endpoint():
    from mrv2_jax.async_llm import EngineStats
    from mrv2_jax.entrypoints.server_metrics import ServerMetrics
    from mrv2_jax.spec_decode.metrics import SpecDecodeStats

    class Engine:
        stats = EngineStats(spec_decode=SpecDecodeStats(2, num_drafts=3, num_draft_tokens=6, num_accepted_tokens=4,
                                                        accepted_per_position=[3, 1]))
        is_healthy = True

    text = ServerMetrics(Engine(), "demo").render()[0].decode()
    assert 'mrv2_spec_decode_num_accepted_tokens_total{model_name="demo"} 4.0' in text
    assert 'mrv2_spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="1"} 1.0' in text
    stats = Engine.stats.spec_decode
    assert stats.acceptance_rate == 4 / 6 and stats.per_position_acceptance == [1.0, 1 / 3]


def test_spec_benchmark_arms_and_table(capsys):
    """The benchmark's plan and report (its engine runs are the engine tests' code paths; the
    GPU run is `scripts/gpu_check.sh spec`)."""
    import argparse

    from mrv2_jax.bench.spec_decode import print_table, suite_arms

    args = argparse.Namespace(num_speculative_tokens=3, acceptance_rates=[0.6, 0.8])
    model, load_format, arms = suite_arms("qwen3-0.6b", args)
    assert (model, load_format) == ("qwen3-0.6b", "dummy")
    assert [spec and spec["acceptance_rate"] for _, spec in arms] == [None, 0.6, 0.8]
    assert suite_arms("demo", args)[2][1][1]["method"] == "draft_model"
    row = dict(suite="demo", spec="draft k=3", output_tokens_per_s=100.0, acceptance_rate=0.5,
               mean_acceptance_length=2.5)
    print_table([row | dict(runner="v1", mean_tpot_ms=2.0), row | dict(runner="v2-async", mean_tpot_ms=1.5)])
    assert "-25.0%" in capsys.readouterr().out


# --- KV budget ------------------------------------------------------------------------------------

class _FakeDevice:
    """A device with 10 GiB, 1 GiB of it in use (the weights): stands in for the GPU's stats."""

    def memory_stats(self):
        return {"bytes_limit": 10 << 30, "bytes_in_use": 1 << 30}


def test_draft_model_kv_comes_out_of_the_same_budget(monkeypatch):
    """build_engine loads the draft before sizing the KV cache and pays for both caches per
    block (the draft's cache has the target's block count). Stopped before the runner is built:
    the device here is a stand-in with fixed memory stats."""
    from mrv2_jax.engine import builder
    from mrv2_jax.models.loader import CHECKPOINTS_DIR, load_model, resolve_dtype
    from mrv2_jax.runner import kv_cache

    class Sized(Exception):
        pass

    seen = {}

    def stop_after_sizing(config, model_state, lm, num_blocks, max_model_len, draft_model=None):
        seen.update(num_blocks=num_blocks, draft=draft_model)
        raise Sized

    monkeypatch.setattr(kv_cache.jax, "local_devices", lambda: [_FakeDevice()])
    monkeypatch.setattr(builder, "make_spec_decoder", stop_after_sizing)
    draft_dir = str(CHECKPOINTS_DIR / "demo-qwen3-draft")
    config = builder.EngineConfig(model="demo", dtype="float32", block_size=16, show_progress=False,
                                  speculative_config={"method": "draft_model", "k": 2, "model": draft_dir})
    with pytest.raises(Sized):
        builder.build_engine(config)
    dtype = resolve_dtype("float32")
    target, draft = load_model("demo", "float32", "auto")[0], seen["draft"][0]
    assert draft.num_layers != target.num_layers or draft.hidden_size != target.hidden_size  # really the draft
    per_block = 16 * (target.kv_bytes_per_token(dtype) + draft.kv_bytes_per_token(dtype))
    free = int((10 << 30) * 0.9) - (1 << 30) - (2 << 30)  # utilization, weights (stand-in), reserve
    assert seen["num_blocks"] == free // per_block
