"""One table from several `benchmarks.host_profile` reports (one per XLA flag set):
    python -m benchmarks.host_profile_table out/host_profile_*.json"""

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    print(f"{'variant':24} {'rows':>5} {'call ms':>8} {'resident':>9} {'traced ms':>10} {'pipelined ms':>13}  "
          "top host events (us)")
    for path in paths:
        report = json.loads(Path(path).read_text())
        name = Path(path).stem.removeprefix("host_profile_")
        for rows, r in report["results"].items():
            top = list(r["traced"]["self_us"].items())[:3]
            tops = "; ".join(f"{k.split(' | ')[-1][:40]} {v:.0f}" for k, v in top)
            resident = r.get("device_resident", {}).get("call_ms", float("nan"))
            print(f"{name:24} {rows:>5} {r['untraced']['call_ms']:8.3f} {resident:9.3f} "
                  f"{r['traced']['call_us'] / 1e3:10.3f} {r['untraced']['pipelined_ms']:13.3f}  {tops}")


if __name__ == "__main__":
    main(sys.argv[1:])
