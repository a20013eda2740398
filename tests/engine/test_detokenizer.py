"""Incremental detokenization against full decodes with a real byte-level BPE tokenizer.

The tokenizer is trained here on a few sentences, with a small vocabulary, so characters
outside its training text (and some inside) are split into single UTF-8 bytes: the
incremental decoder must never emit half a character.
"""

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mrv2_jax.engine.detokenizer import IncrementalDetokenizer
from mrv2_jax.sampling_params import SamplingParams

CORPUS = [
    "héllo wörld 日本語 🙂",
    "hello world, the quick brown fox jumps over the lazy dog.",
    "naïve café déjà vu — ünïcödé",
    "stop here: END of story",
]
TEXTS = [
    "héllo wörld 日本語 🙂",
    "東京 🚀 ẞ — 日本語のテキストです。",
    "the quick brown fox END of story 🙂🙂 done",
    "a\nb\n\nc 😀😀😀 ü",
]
EOS = "<eos>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def stream(detokenizer, token_ids, chunk_sizes=None):
    """Feeds tokens in chunks; returns (deltas, matched stop string)."""
    rng = random.Random(0)
    deltas, index = [], 0
    while index < len(token_ids):
        size = chunk_sizes.pop(0) if chunk_sizes else rng.choice([1, 1, 1, 2, 3])
        delta, stop = detokenizer.update(token_ids[index:index + size])
        deltas.append(delta)
        index += size
        if stop is not None:
            return deltas, stop
    deltas.append(detokenizer.flush())
    return deltas, None


def test_tokenizer_splits_characters_across_tokens(tokenizer):
    """Guards the other tests: the split-character case must really occur."""
    ids = tokenizer.encode(TEXTS[1]).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("the lazy dog ").ids
    ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas, stop = stream(detokenizer, ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detokenizer.output_text == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_a_prompt_ending_inside_a_character_is_context_only(tokenizer):
    prompt = tokenizer.encode("the lazy dog 東").ids[:-1]  # the last byte of 東 is not in the prompt
    assert tokenizer.decode(prompt).endswith("\ufffd")
    ids = tokenizer.encode("hello wörld").ids
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, prompt), ids, chunk_sizes=[1] * len(ids))
    assert "".join(deltas) == "hello wörld"


def test_one_token_at_a_time_emits_whole_characters(tokenizer):
    ids = tokenizer.encode("🚀ẞ東").ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.update([i])[0] for i in ids]
    assert [d for d in deltas if d] == ["🚀", "ẞ", "東"]


def test_transformers_fast_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    ids = tokenizer.encode(TEXTS[0]).ids + [hf_tokenizer.eos_token_id]
    params = SamplingParams(stop="wörld 日")
    deltas, stop = stream(IncrementalDetokenizer.for_request(hf_tokenizer, [], params), ids)
    assert stop == "wörld 日" and "".join(deltas) == "héllo "


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.token_to_id(EOS)
    ids = tokenizer.encode("hello").ids + [eos]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)[0]) == "hello"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(kept, ids)[0]) == "hello" + EOS


def test_unfinished_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("ok 🚀").ids
    cut = ids[:-1]  # the last byte of the rocket never arrives
    assert tokenizer.decode(cut).endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.update([i])[0] for i in cut)
    assert "\ufffd" not in streamed
    assert streamed + detokenizer.flush() == tokenizer.decode(cut)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_token_boundaries(tokenizer, include):
    text = "the quick brown fox END of story 🙂🙂 done"
    stop = "x END o"
    ids = tokenizer.encode(text).ids
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in piece for piece in pieces)  # it does span several tokens
    detokenizer = IncrementalDetokenizer(
        tokenizer, stop=["never", stop], include_stop_str_in_output=include)
    deltas, matched = stream(detokenizer, ids, chunk_sizes=[1] * len(ids))
    end = text.index(stop) + (len(stop) if include else 0)
    assert matched == stop
    assert detokenizer.output_text == text[:end]
    # Nothing streamed was later taken back: the stream is exactly the final text.
    assert "".join(deltas) == text[:end]
    assert detokenizer.update(ids[:2]) == ("", None)  # after a stop, nothing more


def test_stop_string_inside_a_multibyte_run(tokenizer):
    text = "東京 🚀 ẞ — 日本語のテキストです。"
    ids = tokenizer.encode(text).ids
    deltas, matched = stream(IncrementalDetokenizer(tokenizer, stop=["ẞ —"]), ids)
    assert matched == "ẞ —" and "".join(deltas) == "東京 🚀 "


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("hello world, the quick brown fox").ids
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["brown", "world", "the"])
    deltas, matched = stream(detokenizer, ids, chunk_sizes=[len(ids)])
    assert matched == "world" and "".join(deltas) == "hello "


def test_a_long_output_streams_as_its_full_decode(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS) * 20).ids
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, stop=["zzz"]), ids, chunk_sizes=[1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids)


def test_a_tokenizer_without_a_rust_backend_is_refused(tokenizer):
    class DecodeOnly:
        def decode(self, ids, **_):
            return tokenizer.decode(ids)

    with pytest.raises(TypeError, match="needs a tokenizers.Tokenizer or a transformers fast tokenizer"):
        IncrementalDetokenizer(DecodeOnly())


_ALPHABET = st.sampled_from(list("ab の🙂ẞé\n") + ["END", "日本語", " fox"])


@settings(max_examples=120, deadline=None)
@given(parts=st.lists(_ALPHABET, min_size=1, max_size=30), data=st.data())
def test_random_texts_and_stop_strings(tokenizer, parts, data):
    text = "".join(parts)
    ids = tokenizer.encode(text).ids
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:start + data.draw(st.integers(1, 4))]
    include = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    # A prompt cut at any token: its last character may be unfinished (left context only).
    prompt = tokenizer.encode("".join(data.draw(st.lists(_ALPHABET, max_size=4)))).ids
    prompt = prompt[:data.draw(st.integers(0, len(prompt)))]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop=[stop], include_stop_str_in_output=include)
    deltas, matched = stream(detokenizer, ids, chunk_sizes=chunks)
    first = text.index(stop)
    expected = text[:first + len(stop)] if include else text[:first]
    assert matched == stop
    assert "".join(deltas) == detokenizer.output_text == expected
    assert not any("\ufffd" in delta for delta in deltas)
