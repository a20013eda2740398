"""The bucket plan: token sizes in powers of two with rows = min(tokens, max_num_seqs), the
uniform-decode buckets of speculative decoding, extra buckets of fewer rows, token counts the user
names, and `pick` taking the smallest bucket that holds a step."""

import itertools

import pytest

from mrv2_jax.runner.buckets import Bucket, BucketPlan, check_token_sizes, few_row_buckets


def test_the_plan_and_its_extra_buckets():
    plan = BucketPlan(64, 16)
    assert list(plan) == [Bucket(8, 8), Bucket(16, 16), Bucket(32, 16), Bucket(64, 16)]
    assert set(BucketPlan(64, 16, decode_width=3)) - set(plan) == {
        Bucket(3, 1), Bucket(6, 2), Bucket(12, 4), Bucket(24, 8), Bucket(48, 16)}
    with_few_rows = BucketPlan(64, 16, extra=(Bucket(32, 4),))
    assert list(with_few_rows) == [Bucket(8, 8), Bucket(16, 16), Bucket(32, 4), Bucket(32, 16), Bucket(64, 16)]
    for bad in (Bucket(32, 17), Bucket(128, 4), Bucket(8, 9), Bucket(8, 0)):
        with pytest.raises(ValueError, match="does not fit"):
            BucketPlan(64, 16, extra=(bad,))


def test_few_row_buckets_sit_beside_every_bucket_of_more_rows_up_to_the_token_limit():
    # The serving shape: 8192 tokens, 256 rows; unrolled up to 2048 tokens for at most 128 rows.
    assert few_row_buckets(8192, 256, 2048, 128) == tuple(Bucket(t, 128) for t in (256, 512, 1024, 2048))
    # Buckets of up to `rows` tokens already have at most `rows` rows; none is added there.
    assert few_row_buckets(64, 16, 64, 8) == (Bucket(16, 8), Bucket(32, 8), Bucket(64, 8))
    assert few_row_buckets(64, 16, 64, 16) == () and few_row_buckets(64, 4, 64, 8) == ()
    plan = BucketPlan(8192, 256, extra=few_row_buckets(8192, 256, 2048, 128))
    assert plan.pick(128 + 1152, 128) == Bucket(2048, 128) and plan.pick(255, 128) == Bucket(256, 128)
    assert plan.pick(256, 256) == Bucket(256, 256)


def test_pick_takes_the_smallest_bucket_that_holds_the_step():
    plan = BucketPlan(64, 16, extra=(Bucket(32, 4),))
    for tokens, rows in itertools.product(range(1, 65), range(1, 17)):
        if rows > tokens:
            continue
        fits = [b for b in plan if tokens <= b.num_tokens and rows <= b.num_reqs]
        assert plan.pick(tokens, rows) == min(fits, key=lambda b: (b.num_tokens, b.num_reqs))
    assert plan.pick(20, 3) == Bucket(32, 4) and plan.pick(20, 5) == Bucket(32, 16)
    with pytest.raises(ValueError, match="exceeds every bucket"):
        plan.pick(65, 1)


def test_named_token_sizes_replace_the_powers_of_two():
    assert list(BucketPlan(64, 16, sizes=(64, 16))) == [Bucket(16, 16), Bucket(64, 16)]
    assert list(BucketPlan(64, 16, sizes=(64,))) == [Bucket(64, 16)]
    # Speculative decoding's uniform-decode buckets stay only where their token count is named.
    assert set(BucketPlan(64, 16, decode_width=4, sizes=(16, 64))) == {
        Bucket(16, 16), Bucket(64, 16), Bucket(16, 4), Bucket(64, 16)}
    assert BucketPlan(64, 16, sizes=(64,)).pick(3, 1) == Bucket(64, 16)
    for bad in ((32,), (16, 128), (0, 64), ()):
        with pytest.raises(ValueError, match="bucket_token_sizes"):
            check_token_sizes(bad, 64)
