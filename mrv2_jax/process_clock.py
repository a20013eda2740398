"""Seconds since this process started, interpreter start and imports included (a timer started
in Python code misses them). Linux: from /proc; None where that is not available."""

import os


def process_age_s() -> float | None:
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks
    except (OSError, ValueError, IndexError):
        return None
