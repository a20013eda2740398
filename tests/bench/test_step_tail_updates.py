"""benchmarks.step_tail_updates: XLA's command-buffer update lines put into the timeline steps whose wall
clock holds them, counted for the slow steps and for all."""

import datetime
import json

from benchmarks import step_tail_updates


def _glog(epoch_s: float) -> str:
    t = datetime.datetime.fromtimestamp(epoch_s).astimezone()
    return f"I{t:%m%d %H:%M:%S.%f}  123 command_buffer_thunk.cc:1] Updated command buffer: updated_allocs=2"


def test_updates_land_in_the_steps_that_held_them(tmp_path):
    t0 = 1_796_661_641.0
    walls = [1.0, 1.0, 3.0, 1.0, 3.0]  # ms; steps back to back, a millisecond of slack between them
    starts, s = [], 0.0
    for w in walls:
        starts.append(s)
        s += (w + 1.0) / 1e3
    new_blocks, call_ms = [0, 1, 0, 0, 1], [0.4, 0.7, 0.5, 0.3, 0.9]
    timeline = dict(run_start_epoch_s=t0, steps=[dict(start_s=a, wall_ms=w, new_blocks=b, call_ms=c)
                                                 for a, w, b, c in zip(starts, walls, new_blocks, call_ms)])
    # one update inside step 2 (slow), one inside step 1 (not slow), one between steps 3 and 4 (in none)
    log = [_glog(t0 + starts[2] + 0.0015), _glog(t0 + starts[1] + 0.0005), _glog(t0 + starts[3] + 0.0015),
           "I1207 12:00:00.000000  1 other.cc:1] not an update"]
    (tmp_path / "t.json").write_text(json.dumps(timeline))
    (tmp_path / "t.log").write_text("\n".join(log) + "\n")
    step_tail_updates.main([str(tmp_path / "t.json"), str(tmp_path / "t.log"), "--output-json",
                            str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["updates"], r["updates_in_steps"], r["steps_with_update"]) == (3, 2, 2)
    assert (r["slow_steps"], r["slow_steps_with_update"], r["slow_step_indices"]) == (2, 1, [2, 4])
    # Steps 1 and 4 added KV blocks (step 1 saw the update); of the others only step 2 saw one.
    assert r["by_blocks"]["new blocks"] == dict(steps=2, steps_with_update=1, call_ms_median_with_update=0.7,
                                                call_ms_median_without=0.9)
    assert r["by_blocks"]["no new block"] == dict(steps=3, steps_with_update=1, call_ms_median_with_update=0.5,
                                                  call_ms_median_without=0.35)
