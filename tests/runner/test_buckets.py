"""The bucket plan: token sizes in powers of two with rows = min(tokens, max_num_seqs), the
uniform-decode buckets of speculative decoding, extra buckets of fewer rows, and `pick` taking the
smallest bucket that holds a step."""

import itertools

import pytest

from mrv2_jax.runner.buckets import Bucket, BucketPlan


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
