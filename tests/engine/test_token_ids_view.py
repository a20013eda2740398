"""TokenIdsView behaves as a copy of the list's prefix taken when the view was made, however the
list grows afterwards (compared with real list copies)."""

import copy
import pickle
import random

import pytest

from mrv2_jax.engine.token_ids_view import TokenIdsView


def test_views_keep_the_prefix_they_were_made_with():
    rng = random.Random(0)
    ids, snapshots = [], []
    for _ in range(60):
        ids.extend(rng.randrange(1000) for _ in range(rng.randrange(0, 4)))
        snapshots.append((TokenIdsView(ids), list(ids)))
    for view, want in snapshots:
        assert len(view) == len(want) and list(view) == want and view == want and want == view
        for s in (slice(None), slice(2, None), slice(None, -1), slice(1, 7, 2), slice(-3, None)):
            assert view[s] == want[s]
        for i in range(-len(want), len(want)):
            assert view[i] == want[i]
        with pytest.raises(IndexError):
            view[len(want)]
        assert view + [5] == want + [5] and [5] + view == [5] + want
        assert pickle.loads(pickle.dumps(view)) == want and type(pickle.loads(pickle.dumps(view))) is list
        assert copy.deepcopy(view) == want
        assert repr(view) == repr(want)


def test_a_view_is_unequal_to_a_tuple_and_unhashable_like_a_list():
    view = TokenIdsView([1, 2, 3])
    assert view != (1, 2, 3) and view == TokenIdsView([1, 2, 3, 4], 3)
    with pytest.raises(TypeError):
        hash(view)
