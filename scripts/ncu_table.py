"""Print one line per kernel of an Nsight Compute report: name, grid, block, duration, DRAM and compute
throughput, occupancy and its limits (the report exported by `ncu --import R --page raw --csv`)."""

import csv
import sys

COLUMNS = {  # header in the raw page -> short name
    "Kernel Name": "kernel", "Grid Size": "grid", "Block Size": "block",
    "gpu__time_duration.sum": "us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
    "dram__bytes.sum.per_second": "dram B/s",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
    "sm__maximum_warps_per_active_cycle_pct": "theo occ%",
    "launch__registers_per_thread": "regs",
    "launch__shared_mem_per_block_dynamic": "dyn smem",
}


def main(path: str) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    idx = {short: header.index(name) for name, short in COLUMNS.items() if name in header}
    units = rows[1]
    print(" | ".join(f"{k} ({units[i]})" if units[i] else k for k, i in idx.items()))
    for row in rows[2:]:
        print(" | ".join(row[i][:60] for i in idx.values()))


if __name__ == "__main__":
    main(sys.argv[1])
