"""Context-free grammars (`structured_outputs.grammar`) through llguidance, on the host.

A grammar cannot be compiled into the finite tables of automaton.py, so each request keeps an
llguidance matcher on the host instead: the engine feeds it every token the request receives,
and before each step that samples for the request the runner asks it for the next token's
bitmask and writes that into ONE state of the device's automaton pool
(runner/grammar_masks.py). To the pool and the step that state is an automaton of one state
that loops on itself (`default_next` = itself, no exceptions), so the step's own mask and
advance apply it unchanged.

Syntax: what llguidance takes (Lark-like, docs at github.com/guidance-ai/llguidance), or GBNF
(llama.cpp), which llguidance's own converter turns into Lark. EOS is allowed exactly where the
matcher accepts: llguidance's own EOS bit (which it also sets in its error state) is replaced.
"""

from __future__ import annotations

import threading

import numpy as np

_tokenizers: dict[str, object] = {}  # vocabulary fingerprint -> llguidance tokenizer
_tokenizers_lock = threading.Lock()


def _fail(why: str):
    raise ValueError(f"structured_outputs.grammar: {why}")


def grammar_of(text) -> str:
    """llguidance's grammar for `text` (Lark or GBNF), checked without a tokenizer (ValueError
    naming the field)."""
    if not isinstance(text, str) or not text.strip():
        _fail(f"must be a non-empty string, got {text!r}")
    try:
        import llguidance
    except ImportError:
        _fail("grammars need the llguidance package (pip install llguidance)")

    try:
        grammar = llguidance.grammar_from("grammar", text)
    except ValueError as e:
        _fail(str(e))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        _fail(f"invalid grammar: {error.strip()}")
    return grammar


def llg_tokenizer(tokenizer, vocab, eos_token_ids):
    """The llguidance tokenizer of a Hugging Face fast tokenizer over the model's vocabulary
    (`vocab`: a TokenVocabulary, whose fingerprint keys the cache: building one reads the
    whole vocabulary)."""
    with _tokenizers_lock:
        cached = _tokenizers.get(vocab.fingerprint)
    if cached is not None:
        return cached
    import llguidance.hf

    try:
        built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab.vocab_size, eos_token=list(eos_token_ids))
    except ValueError as e:
        _fail(f"needs a fast (tokenizers) tokenizer: {e}")
    with _tokenizers_lock:
        return _tokenizers.setdefault(vocab.fingerprint, built)


class CompiledGrammar:
    """One grammar for one tokenizer: a matcher at its start, which each request copies."""

    def __init__(self, grammar: str, llg_tok, vocab_size: int, eos_token_ids):
        import llguidance

        self._start = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
        if self._start.is_error():
            _fail(self._start.get_error().strip())
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        first = self.matcher()
        if not first.mask().any():
            _fail("no output of this tokenizer satisfies the grammar")

    def matcher(self) -> GrammarMatcher:
        """A request's own matcher, at the start of the grammar."""
        return GrammarMatcher(self._start.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarMatcher:
    """One request's place in its grammar; to the automaton pool, a one-state automaton of its
    own (`shared` False: never reused by another request, dropped when released)."""

    shared = False
    num_states, num_exceptions, start = 1, 0, 0

    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._matcher = matcher
        w = -(-vocab_size // 32)
        self.allowed = np.zeros((1, w), np.uint32)  # what AutomatonWriter copies in first: refilled each step
        self.exception = np.zeros((1, w), np.uint32)
        self.default_next = np.zeros(1, np.int32)  # the state loops on itself
        self.first_exception = np.zeros(1, np.int32)
        self.exception_next = np.zeros(0, np.int32)
        eos = np.asarray(eos_token_ids, np.int64)
        self._eos_words = eos >> 5
        self._eos_bits = (np.uint32(1) << (eos & 31).astype(np.uint32)).astype(np.uint32)

    def walk(self, tokens, state: int | None = None) -> int:
        """The pool state after `tokens`: always the one state (the matcher holds the place)."""
        return 0

    def consume(self, token: int) -> bool:
        """Advance by a received token; False when the matcher cannot continue (its error)."""
        return self._matcher.consume_token(token)

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        """Why the matcher stopped, in one line ("" while it runs)."""
        message = self._matcher.get_error().strip()
        return message.splitlines()[0] if message else ""

    def fill(self, row: np.ndarray) -> None:
        """The next token's bitmask into `row` (int32 or uint32 [W], C-contiguous): the tokens the
        grammar allows, and the EOS ids exactly when the output so far is complete."""
        words = row.view(np.int32)
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = row.view(np.uint32)
        if self._matcher.is_accepting():
            np.bitwise_or.at(bits, self._eos_words, self._eos_bits)
        else:
            np.bitwise_and.at(bits, self._eos_words, ~self._eos_bits)

    def mask(self) -> np.ndarray:
        """u32[W]: the next token's bitmask (as `fill`)."""
        row = np.zeros(self.allowed.shape[1], np.uint32)
        self.fill(row)
        return row
