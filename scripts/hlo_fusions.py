"""Print the fusions whose names match a pattern in XLA's optimized HLO dumps, each with its called
computation and the instructions that use its result (for finding what a small kernel in a
profile computes).

    python scripts/hlo_fusions.py /tmp/hlo 'loop_slice_fusion|loop_broadcast_fusion' [--contains mosaic_gpu]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def computations(text: str) -> dict[str, list[str]]:
    """Each computation's lines by its name (the HLO text's `%name (...) -> ... {` blocks)."""
    blocks, name = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if header:
            name = header.group(1)
            blocks[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None:
            blocks[name].append(line.strip())
    return blocks


def matching_fusions(text: str, pattern: str, limit: int = 4) -> list[dict]:
    """Up to `limit` fusion instructions named by `pattern`: the line, its called computation's lines and
    the lines that read its result."""
    blocks = computations(text)
    lines = [line.strip() for body in blocks.values() for line in body]
    found = []
    for line in lines:
        match = INSTRUCTION.match(line)
        if not match or not re.search(pattern, match.group(1)) or " fusion(" not in match.group(2):
            continue
        name = match.group(1)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        users = [other for other in lines if re.search(rf"%{re.escape(name)}\b", other) and other != line]
        found.append({"name": name, "line": line, "body": blocks.get(called.group(1), []) if called else [],
                      "users": users})
        if len(found) == limit:
            break
    return found


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump_dir")
    p.add_argument("pattern", help="regex on the fusion instruction's name")
    p.add_argument("--contains", default=None, help="only modules whose text contains this string")
    p.add_argument("--limit", type=int, default=4, help="fusions printed a module")
    args = p.parse_args(argv)
    everything = []
    for path in sorted(Path(args.dump_dir).glob("*after_optimizations.txt")):
        text = path.read_text()
        if args.contains and args.contains not in text:
            continue
        found = matching_fusions(text, args.pattern, args.limit)
        if found:
            print(f"== {path.name}")
        for fusion in found:
            print(f"{fusion['line'][:400]}\n  body:")
            print("\n".join(f"    {line[:300]}" for line in fusion["body"]))
            print("  read by:\n" + "\n".join(f"    {line[:300]}" for line in fusion["users"][:4]))
        everything += found
    return everything


if __name__ == "__main__":
    main()
