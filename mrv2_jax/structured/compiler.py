"""Compiling constraints for one tokenizer, with a cache shared by every engine in the process.

Compiling a JSON schema against a large vocabulary takes from milliseconds to seconds, so it
happens when a request arrives (EngineCore.add_request), never inside a step, and each
(constraint, tokenizer) pair is compiled once: requests with the same schema share the result.
A grammar is compiled once too (an llguidance matcher at its start), but each request gets a
matcher of its own, copied from that one (structured/grammar.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mrv2_jax.structured.automaton import TokenAutomaton, compile_automaton
from mrv2_jax.structured.grammar import CompiledGrammar, GrammarMatcher, llg_tokenizer
from mrv2_jax.structured.params import StructuredOutputsParams
from mrv2_jax.structured.vocabulary import TokenVocabulary, vocabulary_of

CACHE_SIZE = 64  # compiled automata kept, least recently used dropped first

_cache: OrderedDict[tuple, TokenAutomaton | CompiledGrammar] = OrderedDict()
_lock = threading.Lock()


class ConstraintCompiler:
    """Constraints -> TokenAutomaton for one tokenizer (its vocabulary is read on first use).
    `load_tokenizer`: called on first use instead of passing `tokenizer` (one still loading)."""

    def __init__(self, tokenizer, eos_token_ids, vocab_size: int, *, load_tokenizer: Callable[[], Any] | None = None):
        self._tokenizer, self._eos, self._vocab_size = tokenizer, tuple(eos_token_ids), vocab_size
        self._load_tokenizer = load_tokenizer
        self._vocab: TokenVocabulary | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None and self._load_tokenizer is not None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    @property
    def vocabulary(self) -> TokenVocabulary:
        if self._vocab is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            self._vocab = vocabulary_of(self.tokenizer, self._eos, self._vocab_size)
        return self._vocab

    def cached(self, params: StructuredOutputsParams) -> TokenAutomaton | CompiledGrammar | None:
        """The compiled form of `params` if it is compiled already, else None (never compiles)."""
        with _lock:
            return _cache.get((self.vocabulary.fingerprint, params.key))

    def compile(self, params: StructuredOutputsParams) -> TokenAutomaton | GrammarMatcher:
        """The cached automaton of `params`, or for a grammar a new matcher of its own
        (ValueError naming the field if it cannot be built)."""
        vocab = self.vocabulary
        key = (vocab.fingerprint, params.key)
        with _lock:
            compiled = _cache.get(key)
            if compiled is not None:
                _cache.move_to_end(key)
        if compiled is None:
            compiled = self._compile(params, vocab)
            with _lock:
                _cache[key] = compiled
                while len(_cache) > CACHE_SIZE:
                    _cache.popitem(last=False)
        return compiled.matcher() if isinstance(compiled, CompiledGrammar) else compiled

    def _compile(self, params: StructuredOutputsParams, vocab: TokenVocabulary) -> TokenAutomaton | CompiledGrammar:
        if params.kind == "grammar":  # (its errors name the field already)
            tokenizer = llg_tokenizer(self.tokenizer, vocab, self._eos)
            return CompiledGrammar(params.llguidance_grammar, tokenizer, vocab.vocab_size, self._eos)
        try:
            return compile_automaton(params.pattern, vocab)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{params.kind}: {e}") from None
