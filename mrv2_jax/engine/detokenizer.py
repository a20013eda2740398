"""Incremental detokenization with stop strings.

Decoding each new token on its own is wrong in two ways: a multi-byte UTF-8 character
may be split across tokens (decoding half of it yields U+FFFD), and some tokenizers
render a token differently depending on its left neighbour (leading-space markers).
Re-decoding the whole output every step is right but O(length) per token.

The Rust tokenizer's own ``tokenizers.decoders.DecodeStream`` does it incrementally: it keeps
the text decoded so far from a short window of ids, decodes the window with the new tokens once
per step, emits the difference and slides the window, and holds tokens back while the text ends
in an unfinished character. It starts from the prompt's last few tokens as left context.

Stop strings are searched only in the part of the text that the new characters can
complete. While a request runs, the last ``len(longest stop) - 1`` characters are held
back from the stream (unless stop strings are included in the output), because they may
turn out to be the start of a stop string that must not be shown.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from mrv2_jax.sampling_params import SamplingParams

# Tokens kept as left context: the prompt's for the first output tokens, and the stream's last
# ones for the unfinished character a flush decodes.
_CONTEXT_TOKENS = 5


def rust_tokenizer(tokenizer) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` of a Rust tokenizer or of a transformers fast tokenizer."""
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else getattr(
        tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise TypeError(f"detokenizing needs a tokenizers.Tokenizer or a transformers fast tokenizer "
                        f"(one with a backend_tokenizer), got {type(tokenizer).__name__}")
    return backend


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a few tokens at a time.

    ``update(new_token_ids)`` returns ``(delta_text, matched_stop_string)``; once a stop
    string matched, ``output_text`` is final (cut before the stop string, or after it when
    ``include_stop_str_in_output``) and later updates return ``("", None)``. When the request
    ends for another reason, ``flush()`` returns the text still held back.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = rust_tokenizer(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # Without a trailing unfinished character: DecodeStream would emit such a context as text.
        while context and self._tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # The last ids whose text was emitted (a flush's left context).
        self._context = deque(context, maxlen=_CONTEXT_TOKENS)
        self._pending: list[int] = []  # ids the stream holds back: an unfinished character
        self._stop = list(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._holdback = 0 if include_stop_str_in_output else max(self._max_stop_len - 1, 0)
        self.output_text = ""
        self._num_chars_emitted = 0
        self.matched_stop_string: str | None = None

    @classmethod
    def for_request(
        cls, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def update(self, new_token_ids: Sequence[int]) -> tuple[str, str | None]:
        if self.matched_stop_string is not None or not new_token_ids:
            return "", None
        new_token_ids = list(new_token_ids)
        text = self._stream.step(self._tokenizer, new_token_ids)
        if text is None:
            self._pending += new_token_ids
            return self._append("", final=False)
        if self._pending:
            self._context.extend(self._pending)
            self._pending = []
        self._context.extend(new_token_ids)
        return self._append(text, final=False)

    def flush(self) -> str:
        """Everything not yet streamed, including an unfinished character at the end."""
        if self.matched_stop_string is not None:
            return ""
        text = ""
        if self._pending:  # what the stream holds back, decoded after its left context
            decode = self._tokenizer.decode
            context = list(self._context)
            prefix = decode(context, skip_special_tokens=self._skip_special_tokens)
            full = decode(context + self._pending, skip_special_tokens=self._skip_special_tokens)
            text = full[len(prefix):] if len(full) > len(prefix) else ""
            self._pending = []
        delta, _ = self._append(text, final=True)
        return delta

    def _append(self, new_text: str, final: bool) -> tuple[str, str | None]:
        if not self._stop:  # nothing to search for or hold back: all new text goes out
            self.output_text += new_text
            return new_text, None
        if new_text:
            # A stop string completed by the new text must end inside it, so it starts at
            # most (longest stop - 1) characters before it.
            search_from = max(0, len(self.output_text) - self._max_stop_len + 1)
            self.output_text += new_text
            self._cut_at_stop_string(search_from)
        done = final or self.matched_stop_string is not None
        emit_to = len(self.output_text) if done else len(self.output_text) - self._holdback
        if emit_to <= self._num_chars_emitted:
            return "", self.matched_stop_string
        delta = self.output_text[self._num_chars_emitted:emit_to]
        self._num_chars_emitted = emit_to
        return delta, self.matched_stop_string

    def _cut_at_stop_string(self, search_from: int) -> None:
        earliest: tuple[int, str] | None = None
        for stop in self._stop:
            start = self.output_text.find(stop, search_from)
            if start != -1 and (earliest is None or start < earliest[0]):
                earliest = (start, stop)
        if earliest is None:
            return
        start, stop = earliest
        end = start + len(stop) if self._include_stop else start
        self.output_text = self.output_text[:end]
        self.matched_stop_string = stop
