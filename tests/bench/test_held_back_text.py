"""benchmarks/held_back_text.py's count of empty deltas against a brute-force reference: decode each
output's first i tokens whole; a token holds its text back when the text, less a trailing unfinished
character, did not grow."""

from benchmarks.held_back_text import draw, empty_deltas
from benchmarks.host_fakes import DEMO_TOKENIZER, load_tokenizer_arg


def _reference_empty(tokenizer, output: list[int]) -> int:
    empty, shown = 0, 0
    for i in range(1, len(output) + 1):
        text = tokenizer.backend_tokenizer.decode(output[:i], skip_special_tokens=True)
        stable = len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else len(text)
        empty += stable <= shown
        shown = max(shown, stable)
    return empty


def test_empty_deltas_match_whole_decodes():
    tokenizer = load_tokenizer_arg(str(DEMO_TOKENIZER))
    requests = draw(tokenizer, requests=3, tokens=64, prompt_len=0, seed=1)
    assert all(len(out) == 64 and not prompt for prompt, out in requests)
    special = set(tokenizer.all_special_ids)
    assert not any(t in special for _, out in requests for t in out)
    expected = sum(_reference_empty(tokenizer, out) for _, out in requests)
    assert 0 < expected < 3 * 64  # the demo's byte-level vocabulary splits characters often
    assert empty_deltas(tokenizer, requests) == expected
