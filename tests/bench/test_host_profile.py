"""benchmarks/host_profile.py's trace arithmetic against a brute-force reference: self time of
nested trace events, and the per-call split of a Perfetto trace."""

import random

from benchmarks.host_profile import CALL_ANNOTATION, event_family, host_split, self_times


def nested_events(rng, lo, hi, depth, names):
    """Random properly nested events inside [lo, hi) (integers); no two share both ends."""
    out, t = [], lo
    while depth and t < hi - 2 and rng.random() < 0.8:
        start = rng.randint(t, hi - 2)
        end = rng.randint(start + 1, hi)
        out.append((float(start), float(end), rng.choice(names)))
        out += nested_events(rng, start + 1, end, depth - 1, names)
        t = end
    return out


def brute_self_times(events):
    """Each microsecond goes to the innermost event covering it (the latest to start, the
    shortest on ties: the same order nesting implies)."""
    out = {}
    for t in range(int(min(e[0] for e in events)), int(max(e[1] for e in events))):
        covering = [e for e in events if e[0] <= t < e[1]]
        if covering:
            inner = max(covering, key=lambda e: (e[0], -e[1]))
            out[inner[2]] = out.get(inner[2], 0.0) + 1.0
    return out


def test_self_times_match_a_per_microsecond_count():
    rng = random.Random(0)
    for _ in range(50):
        events = nested_events(rng, 0, 200, 4, ["a", "b", "c", "d"])
        if not events:
            continue
        got = self_times(events)
        want = brute_self_times(events)
        assert {k: v for k, v in got.items() if v} == want


def test_event_family_drops_instance_parts():
    assert event_family("ThunkExecutor::Execute#id=3,kind=x#") == "ThunkExecutor::Execute"
    assert event_family("command_buffer_12") == "command_buffer"
    assert event_family("PjitFunction(jit(step))") == "PjitFunction(jit(step))"


def test_host_split_counts_each_call_on_its_own():
    """Two calls with known nesting; an event outside the calls is ignored and a device event
    never counts as host time."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "python"}}]

    def ev(name, ts, dur, pid=1):
        return {"ph": "X", "name": name, "pid": pid, "tid": 7, "ts": ts, "dur": dur}

    events = meta + [ev(CALL_ANNOTATION, 0, 100), ev("Execute", 10, 80), ev("Alloc#n=1#", 20, 30),
                     ev(CALL_ANNOTATION, 1000, 300), ev("Execute", 1010, 280), ev("Alloc#n=2#", 1020, 10),
                     ev("between", 500, 100), ev("kernel", 20, 50, pid=2)]
    split = host_split({"traceEvents": events}, 2)
    assert split["calls"] == 2 and split["call_us"] == 200.0
    # Medians over the two calls: Execute self 50 and 270, Alloc 30 and 10, annotation 20 and 20.
    assert split["count"] == {"python | Execute": 1, "python | Alloc": 1, f"python | {CALL_ANNOTATION}": 1}
    assert split["self_us"] == {"python | Execute": 160.0, "python | Alloc": 20.0, f"python | {CALL_ANNOTATION}": 20.0}
