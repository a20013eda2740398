"""A py-spy raw profile as a call tree below one function: each node's share of the samples that
pass through that function, inclusive and self.

    python -m benchmarks.pyspy_tree native.txt --root ModelRunnerV2.call_step [--min-share 1.5]

Reads py-spy's `--format raw` output (one line per distinct stack, frames joined by ";", then a
sample count; `gpu_check.sh call-native` records one with `--native`, so XLA's C++ frames are in
it). Only samples whose stack holds `--root` count; each is cut to the frames from the root's first
occurrence on. Nodes under `--min-share` percent are left out. Native unwinding loses a frame now
and then, which hangs a subtree one level too high: `--flat` also prints each function's inclusive
share (a function counts once per sample, wherever it sits), which such losses do not change.
"""

import argparse
import json
import re
from collections import Counter

from benchmarks.pyspy_engine import function_name


def frame_name(frame: str) -> str:
    """A frame without its file and line: `name (path/file.py:12)` -> `name`; C++ frames keep
    their qualified name."""
    return re.sub(r" \([^()]*\)$", "", function_name(frame))


def stacks_below(lines, root: str):
    """-> [(frames from `root` on, samples)] of the stacks that pass through `root`."""
    out = []
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        names = [frame_name(f) for f in stack.split(";")]
        if root in names:
            out.append((names[names.index(root):], int(count)))
    return out


def call_tree(stacks) -> dict:
    """{"samples": n, "children": {name: node}} merged over the stacks' frame paths."""
    tree = {"samples": 0, "children": {}}
    for names, count in stacks:
        node = tree
        for name in names:
            node = node["children"].setdefault(name, {"samples": 0, "children": {}})
            node["samples"] += count
        tree["samples"] += count
    return tree


def flat_shares(stacks) -> Counter:
    """{function: samples whose stack holds it}."""
    inclusive = Counter()
    for names, count in stacks:
        for name in set(names):
            inclusive[name] += count
    return inclusive


def tree_rows(node: dict, total: int, min_share: float, depth: int = 0, name: str | None = None) -> list:
    """[(depth, name, inclusive %, self %)] depth first, children largest first."""
    rows = []
    if name is not None:
        own = node["samples"] - sum(c["samples"] for c in node["children"].values())
        rows.append((depth, name, 100 * node["samples"] / total, 100 * own / total))
        depth += 1
    for child_name, child in sorted(node["children"].items(), key=lambda kv: -kv[1]["samples"]):
        if 100 * child["samples"] / total >= min_share:
            rows += tree_rows(child, total, min_share, depth, child_name)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--root", required=True, help="the function whose samples are split, e.g. ModelRunnerV2.call_step")
    p.add_argument("--min-share", type=float, default=1.5, help="leave out nodes under this percentage")
    p.add_argument("--flat", type=int, default=0, metavar="N", help="also print the N largest inclusive shares")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    with open(args.profile) as f:
        stacks = stacks_below(f, args.root)
    tree = call_tree(stacks)
    total = tree["samples"]
    if not total:
        raise SystemExit(f"no sample in {args.profile} passes through {args.root}")
    rows = tree_rows(tree, total, args.min_share)
    print(f"{args.root}: {total} samples; inclusive % (self %) of them")
    for depth, name, inclusive, own in rows:
        print(f"{'  ' * min(depth, 16)}{inclusive:5.1f} ({own:4.1f})  {name[:120]}")
    flat = flat_shares(stacks).most_common(args.flat)
    if flat:
        print("\ninclusive share per function")
        for name, n in flat:
            print(f"{100 * n / total:6.1f}%  {name[:140]}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"root": args.root, "samples": total, "min_share": args.min_share,
                       "tree": [{"depth": d, "name": n, "inclusive_pct": i, "self_pct": s} for d, n, i, s in rows],
                       "flat": [{"name": n, "inclusive_pct": 100 * c / total} for n, c in flat]}, f, indent=1)


if __name__ == "__main__":
    main()
