"""A tokenizer's vocabulary as the bytes each token stands for (what outlines-core matches).

Byte-level BPE tokenizers (GPT-2, Qwen, GLM) spell each byte with one printable character
(GPT-2's `bytes_to_unicode`); SentencePiece-style `<0xNN>` tokens are single bytes; any other
token is its decoded text in UTF-8. Special tokens (EOS among them) are never part of a
constrained output: the automaton allows EOS itself, in its final states.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


@dataclass(frozen=True)
class TokenVocabulary:
    """token bytes -> token ids (several ids may spell the same bytes), the EOS ids, the
    model's vocabulary size (logit width) and a fingerprint for caches."""

    tokens: dict[bytes, list[int]]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    fingerprint: str


def token_bytes(token: str, decode) -> bytes | None:
    """The bytes one token stands for (`decode(token)`: its text, asked only for tokens that are
    neither byte-level nor <0xNN>); None if it has none (an empty token)."""
    m = _BYTE_TOKEN.match(token)
    if m:
        return bytes([int(m.group(1), 16)])
    if token and all(c in _UNICODE_TO_BYTE for c in token):
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    return decode(token).encode("utf-8") or None


def vocabulary_of(tokenizer, eos_token_ids, vocab_size: int) -> TokenVocabulary:
    """The TokenVocabulary of a Hugging Face tokenizer (special tokens left out)."""
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(eos_token_ids)
    tokens: dict[bytes, list[int]] = {}
    digest = hashlib.sha256()
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if token_id in special or token_id >= vocab_size:
            continue
        spelled = token_bytes(token, lambda t: tokenizer.convert_tokens_to_string([t]))
        if spelled is not None:
            tokens.setdefault(spelled, []).append(token_id)
            digest.update(token_id.to_bytes(4, "little") + spelled + b"\0")
    digest.update(repr((tuple(eos_token_ids), vocab_size)).encode())
    return TokenVocabulary(tokens, tuple(eos_token_ids), vocab_size, digest.hexdigest())
