"""Incremental detokenization with stop strings.

Decoding each new token on its own is wrong in two ways: a multi-byte UTF-8 character
may be split across tokens (decoding half of it yields U+FFFD), and some tokenizers
render a token differently depending on its left neighbour (leading-space markers).
Re-decoding the whole output every step is right but O(length) per token.

The offsets trick keeps a short window of token ids: ``[prefix_offset, read_offset)`` is
text already emitted, kept only as left context; ``[read_offset, end)`` is new. Each update
decodes the window with and without the new tokens and emits the difference, unless
the decoded text ends in U+FFFD (an unfinished character): then it waits for more
tokens. After emitting, the window slides forward, so the work per update is proportional
to the new tokens, not to the output length.

Stop strings are searched only in the part of the text that the new characters can
complete. While a request runs, the last ``len(longest stop) - 1`` characters are held
back from the stream (unless stop strings are included in the output), because they may
turn out to be the start of a stop string that must not be shown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tokenizers

from mrv2_jax.sampling_params import SamplingParams

# Prompt tokens kept as left context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE_CHAR = "\ufffd"


def _make_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A ``decode(token_ids) -> str`` for a ``tokenizers.Tokenizer``, a transformers fast
    tokenizer, or anything with a transformers-style ``decode``. Decoding goes straight
    to the Rust tokenizer where there is one: no Python wrapper per call, and no
    clean-up of tokenization spaces, which would make window decodes disagree with a
    decode of the whole output."""
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else getattr(
        tokenizer, "backend_tokenizer", None
    )
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


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
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window)
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
        if self.matched_stop_string is not None:
            return "", None
        self._window.extend(new_token_ids)
        return self._append(self._decode_window(allow_incomplete=False), final=False)

    def flush(self) -> str:
        """Everything not yet streamed, including an unfinished character at the end."""
        if self.matched_stop_string is not None:
            return ""
        delta, _ = self._append(self._decode_window(allow_incomplete=True), final=True)
        return delta

    def _decode_window(self, allow_incomplete: bool) -> str:
        """New text of the window's unread tokens; slides the window when there is some."""
        window = self._window
        prefix_text = self._decode(window[self._prefix_offset:self._read_offset])
        full_text = self._decode(window[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_INCOMPLETE_CHAR) and not allow_incomplete:
            return ""
        # The new read region becomes the next left context; older ids are not needed.
        del window[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(window)
        return full_text[len(prefix_text):]

    def _append(self, new_text: str, final: bool) -> tuple[str, str | None]:
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
