#!/usr/bin/env python3
"""The tensor-parallel step against tp 1, per cell, from kvfuse-bench-engine --json files.

    scripts/gpu/tp-ratios.py BASE.json NAME=FILE.json [NAME=FILE.json ...]

BASE is the tp 1 run; each NAME=FILE another run of the same cells (tp 2 with some path,
or rank 0 of tp 2 alone). Prints, per batch x context cell, every run's step in ms and its
ratio to BASE, then the tp 2 targets (batch 1 x 512 at 0.65x or less, batch 64 x 2048 at
0.60x or less) for each run (a run named *alone* is a floor for them, not a verdict), and, where runs named `tp2` and `tp2-push` are both given,
push against auto per cell. A cell missing from a run is shown as '-'. Exit status 0
unless a file cannot be read.
"""
import json
import sys

TARGETS = {(1, 512): 0.65, (64, 2048): 0.60}


def steps(path):
    """{(batch, context): step ms} of a kvfuse-bench-engine --json file (its first variant)."""
    with open(path) as f:
        data = json.load(f)
    out = {}
    for cell in data.get("cells", []):
        variants = cell.get("variants") or []
        if variants and "step_ms" in variants[0]:
            out[(int(cell["batch"]), int(cell["context"]))] = float(variants[0]["step_ms"])
    return out


def main(argv):
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        base = steps(argv[1])
        runs = [(name, steps(path)) for name, path in (a.split("=", 1) for a in argv[2:])]
    except (OSError, ValueError, KeyError) as e:
        print(f"tp-ratios: {e}", file=sys.stderr)
        return 1
    cells = sorted(base)
    header = f"{'batch':>5} {'context':>7} {'tp1 ms':>8}" + "".join(f" {name + ' ms':>14} {'/ tp1':>6}" for name, _ in runs)
    print(header)
    for cell in cells:
        line = f"{cell[0]:>5} {cell[1]:>7} {base[cell]:>8.3f}"
        for _, run in runs:
            if cell in run:
                line += f" {run[cell]:>14.3f} {run[cell] / base[cell]:>6.3f}"
            else:
                line += f" {'-':>14} {'-':>6}"
        print(line)
    for (batch, context), limit in TARGETS.items():
        if (batch, context) not in base:
            print(f"target {batch} x {context} at <= {limit:.2f}x: no tp 1 cell")
            continue
        for name, run in runs:
            if (batch, context) in run:
                ratio = run[(batch, context)] / base[(batch, context)]
                if "alone" in name:  # rank 0 of the group without its collectives: a floor
                    verdict = "a floor, the collectives left out"
                else:
                    verdict = "met" if ratio <= limit else "missed"
                print(f"target {batch} x {context} at <= {limit:.2f}x: {name} {ratio:.3f}x, {verdict}")
    named = dict(runs)
    if "tp2" in named and "tp2-push" in named:
        pairs = [c for c in cells if c in named["tp2"] and c in named["tp2-push"]]
        print("push / auto: " + ", ".join(f"{b} x {c} {named['tp2-push'][(b, c)] / named['tp2'][(b, c)]:.3f}"
                                          for b, c in pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
