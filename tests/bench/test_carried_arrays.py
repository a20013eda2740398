"""benchmarks.carried_arrays: each way computes what its plain numpy loop does, and the report holds every count."""

import numpy as np

from benchmarks.carried_arrays import main, ways


def test_each_way_carries_the_arrays_as_a_plain_loop_would():
    for count in (1, 3):
        reference = [np.full(4, i, np.int32) for i in range(count)]
        got = ways(count, 4)
        donated, state = got["donated"]
        for _ in range(2):
            state = donated(state)
        assert [np.asarray(x).tolist() for x in state] == [(r + 2).tolist() for r in reference]
        read_only, state = got["read only"]
        assert [np.asarray(x).tolist() for x in read_only(state)] == [r.tolist() for r in reference]
        table, state = got["one table"]
        np.testing.assert_array_equal(np.asarray(table(state)), np.stack(reference) + 1)


def test_the_report_has_every_count_and_way(tmp_path):
    report = main(["--counts", "1", "2", "--rows", "4", "--calls", "3", "--output-json", str(tmp_path / "r.json")])
    assert sorted(report["results"]) == [1, 2]
    assert all(set(r) == {"donated", "read only", "one table"} and min(r.values()) > 0
               for r in report["results"].values())
    assert (tmp_path / "r.json").exists()
