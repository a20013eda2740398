"""Print the fusions whose names match a pattern in XLA's optimized HLO dumps, each with its called
computation and the instructions that use its result (for finding what a small kernel in a
profile computes); or, with --census, every computation's kernel-launching instructions (fusions,
custom calls, copies) with the JAX op each came from, computation by computation (a while loop's body
is one of them: what one iteration launches).

    python scripts/hlo_fusions.py /tmp/hlo 'loop_slice_fusion|loop_broadcast_fusion' [--contains mosaic_gpu]
    python scripts/hlo_fusions.py /tmp/hlo --census [--contains mosaic_gpu]
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


LAUNCHES = re.compile(r"\b(fusion|custom-call|copy|copy-start|scatter|sort|gather|dynamic-update-slice)\(")


def census(text: str) -> dict[str, list[dict]]:
    """Each computation's instructions that launch work of their own (not those inside a fusion's body):
    name, what (the custom call's target, else the opcode) and the JAX op_name of its metadata."""
    blocks = computations(text)
    fusion_bodies = {m.group(1) for lines in blocks.values() for line in lines if " fusion(" in line
                     for m in [re.search(r"calls=%?([\w.\-]+)", line)] if m}
    found = {}
    for name, lines in blocks.items():
        if name in fusion_bodies:
            continue
        rows = []
        for line in lines:
            match = INSTRUCTION.match(line)
            kind = LAUNCHES.search(match.group(2)) if match else None
            if not kind:
                continue
            target = re.search(r'custom_call_target="([^"]+)"', line)
            op_name = re.search(r'op_name="([^"]+)"', line)
            rows.append({"name": match.group(1), "what": target.group(1) if target else kind.group(1),
                         "op_name": op_name.group(1) if op_name else ""})
        if rows:
            found[name] = rows
    return found


def print_census(found: dict[str, list[dict]]) -> None:
    """The census, computations with the most launching instructions first."""
    for name, rows in sorted(found.items(), key=lambda item: -len(item[1])):
        print(f"-- {name}: {len(rows)} launching instructions")
        for row in rows:
            print(f"    {row['name'][:48]:48} {row['what'][:20]:20} {row['op_name'][:110]}")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump_dir")
    p.add_argument("pattern", nargs="?", default=None, help="regex on the fusion instruction's name")
    p.add_argument("--census", action="store_true", help="every computation's launching instructions instead")
    p.add_argument("--contains", default=None, help="only modules whose text contains this string")
    p.add_argument("--limit", type=int, default=4, help="fusions printed a module")
    args = p.parse_args(argv)
    if (args.pattern is None) != args.census:
        p.error("give a pattern or --census, not both")
    everything = []
    for path in sorted(Path(args.dump_dir).glob("*after_optimizations.txt")):
        text = path.read_text()
        if args.contains and args.contains not in text:
            continue
        if args.census:
            print(f"== {path.name}")
            found = census(text)
            print_census(found)
            everything.append({"module": path.name, "computations": found})
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
