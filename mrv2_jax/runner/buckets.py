"""Fixed-shape buckets: the JAX analogue of CUDA-graph capture sizes.

A step is padded to the smallest bucket that holds its tokens, so XLA compiles one variant per
bucket at start-up and never again. Row count follows the token count
(`rows = min(tokens, max_num_seqs)`), which keeps the number of variants to the length of one
short list instead of a grid of (tokens x rows) pairs. The token counts are powers of two unless
the user names them (`bucket_token_sizes`, as vLLM's CUDA-graph capture sizes): fewer buckets,
fewer programs to compile, more padding per step.

With speculative decoding every decoding row carries `decode_width` = 1 + k tokens, so a pure
decode batch of r rows has r * (1 + k) tokens; uniform-decode buckets (r * (1 + k) tokens, r
rows, r a power of two) keep its row padding (and the sampler's 1 + k logits per row) small.
"""

from dataclasses import dataclass


def token_sizes(max_num_batched_tokens: int, min_tokens: int = 8) -> list[int]:
    """The plan's token counts: powers of two from `min_tokens` up, ending at the budget."""
    return _powers_of_two(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)


def _powers_of_two(lo: int, hi: int) -> list[int]:
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= 2
    sizes.append(hi)
    return sizes


@dataclass(frozen=True)
class Bucket:
    num_tokens: int  # padded length of the flattened token axis
    num_reqs: int  # padded number of batch rows


def few_row_buckets(max_num_batched_tokens: int, max_num_seqs: int, max_tokens: int, rows: int,
                    sizes: tuple[int, ...] | None = None) -> tuple[Bucket, ...]:
    """Buckets of `rows` rows at each of the plan's token counts (`sizes`, default `token_sizes`)
    up to `max_tokens` whose own bucket has more rows (the V2 runner unrolls them: runner/v2.py,
    unrolled_layers_max_rows)."""
    return tuple(Bucket(t, rows) for t in sizes or token_sizes(max_num_batched_tokens)
                 if t <= max_tokens and rows < min(t, max_num_seqs))


def check_token_sizes(sizes, max_num_batched_tokens: int) -> tuple[int, ...]:
    """A chosen list of bucket token counts -> sorted and distinct; every step must fit the largest,
    so it must be `max_num_batched_tokens`."""
    sizes = tuple(sorted(set(sizes)))
    if not sizes or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in sizes):
        raise ValueError(f"bucket_token_sizes must be ints >= 1, got {sizes!r}")
    if sizes[-1] != max_num_batched_tokens:
        raise ValueError(f"bucket_token_sizes must end at max_num_batched_tokens ({max_num_batched_tokens}), "
                         f"so that every step fits a bucket; got {list(sizes)}")
    return sizes


class BucketPlan:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 8,
                 decode_width: int = 1, extra: tuple[Bucket, ...] = (), sizes: tuple[int, ...] | None = None):
        """`extra`: buckets besides the plan's own (a runner that wants a program for fewer rows
        at some token count); each must fit the limits. `sizes`: the token counts to plan instead
        of the powers of two (check_token_sizes); speculative decoding's uniform-decode buckets
        are then kept only where their token count is one of them."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.max_num_seqs = max_num_seqs
        sizes = check_token_sizes(sizes, max_num_batched_tokens) if sizes else None
        buckets = {Bucket(t, min(t, max_num_seqs)) for t in sizes or token_sizes(max_num_batched_tokens, min_tokens)}
        if decode_width > 1:
            buckets |= {Bucket(r * decode_width, r) for r in _powers_of_two(1, max_num_seqs)
                        if r * decode_width <= max_num_batched_tokens and (sizes is None or r * decode_width in sizes)}
        for b in extra:
            if not (1 <= b.num_reqs <= min(b.num_tokens, max_num_seqs) and b.num_tokens <= max_num_batched_tokens):
                raise ValueError(f"{b} does not fit {max_num_batched_tokens} tokens / {max_num_seqs} rows")
        buckets |= set(extra)
        # Smallest first, so `pick` takes the cheapest bucket that fits.
        self.buckets = tuple(sorted(buckets, key=lambda b: (b.num_tokens, b.num_reqs)))

    def pick(self, num_tokens: int, num_reqs: int) -> Bucket:
        for b in self.buckets:
            if num_tokens <= b.num_tokens and num_reqs <= b.num_reqs:
                return b
        raise ValueError(f"a step of {num_tokens} tokens / {num_reqs} rows exceeds every bucket "
                         f"(largest {self.buckets[-1]})")

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self):
        return len(self.buckets)
