#!/usr/bin/env python3
"""Reduce a kernel trace of kvfuse-bench-engine to one decode step.

The trace is bench/profile/kvfuse_trace.cc's CSV: what (K kernel, C copy, R runtime
call), start ns, end ns, correlation id, (kernels:) grid, name.

Kernels launched by one graph launch share its correlation id; the launch with the most
kernels is the decode step's graph. Prints, for the last ten replays of that graph, its
kernels grouped by name: count per step, and per step the time from each kernel's start
to its end ("in flight") and the time by which it moved the step's end ("advance": its
end minus the latest end before it, or its start if later). Under programmatic launch a
kernel starts during its predecessor and waits in-kernel, so in-flight times overlap and
add up to more than the step; the advances add up to the step's span, and attribute it.
Then the sum of kernel time, the span from the
first kernel's start to the last one's end, the time the device was idle inside it, and
the idle time between consecutive replays (the host's share of a step), and the host's
runtime calls and the copies inside the last such gap, from the end of one replay's last
kernel to the start of the next one's first.
With --by-grid REGEX the kernels whose names match are also grouped by their grid (one
row per projection shape for the GEMVs, whose grid follows the weight's rows).
Usage: scripts/gpu/profile-table.py trace.csv [--by-grid REGEX]
"""
import lzma
import re
import shutil
import subprocess
import sys
from collections import OrderedDict, defaultdict


_names = {}


def short_names(mangled):
    """The kernel's demangled name without namespaces and parameter list."""
    if mangled not in _names:
        name = mangled
        if shutil.which("c++filt"):
            name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip() or mangled
        name = name.replace("(anonymous namespace)::", "")
        name = name[5:] if name.startswith("void ") else name
        name = re.sub(r"[A-Za-z_0-9]+::", "", name.split("(")[0])
        _names[mangled] = name
    return _names[mangled]


def main(path, by_grid=None):
    rows, other = [], []
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        for line in f:
            what, start, end, corr, name = line.rstrip("\n").split(",", 4)
            if what == "K":
                grid = ""
                if re.match(r"\d+x\d+x\d+,", name):  # traces before the grid column have none
                    grid, name = name.split(",", 1)
                short = short_names(name)
                if by_grid and re.search(by_grid, short):
                    short = f"[grid {grid}] {short}"
                rows.append((int(start), int(end), short, int(corr)))
            else:
                other.append((int(start), int(end), what, name))
    rows.sort()
    other.sort()
    if not rows:
        print("profile-table: no kernels in", path)
        return 1
    by_launch = defaultdict(list)
    for r in rows:
        by_launch[r[3]].append(r)
    largest = max(len(v) for v in by_launch.values())
    replays = sorted((v for v in by_launch.values() if len(v) == largest), key=lambda v: v[0][0])
    shown = replays[-10:]
    print(f"profile-table: {len(rows)} kernels, {len(replays)} launches of {largest} kernels "
          f"(the step's graph); per step, over the last {len(shown)}")
    groups = OrderedDict()
    for step in shown:
        latest = step[0][0]
        for s, e, name, _ in step:
            g = groups.setdefault(name, [0, 0.0, 0.0])
            g[0] += 1
            g[1] += (e - s) / 1000
            g[2] += max(0, e - max(latest, s)) / 1000
            latest = max(latest, e)
    reps = len(shown)
    print(f"{'kernel':56s} {'count':>5s} {'in flight us':>12s} {'advance us':>11s} {'per call':>9s}")
    for name, (n, t, adv) in sorted(groups.items(), key=lambda kv: -kv[1][2]):
        print(f"{name[:56]:56s} {n // reps:5d} {t / reps:12.1f} {adv / reps:11.1f} {adv / n:9.2f}")
    step = replays[-1]
    span = (max(e for _, e, _, _ in step) - step[0][0]) / 1000
    busy = sum(e - s for s, e, _, _ in step) / 1000
    print("(the last replay:)")
    print(f"step kernels {len(step)}: sum of kernel time {busy:.1f} us, span {span:.1f} us "
          f"(kernels overlap under programmatic launch, so the sum can exceed the span)")
    gaps = sorted((step[i + 1][0] - step[i][1]) / 1000 for i in range(len(step) - 1))
    if gaps:
        print(f"start of a kernel after the end of the one before: median {gaps[len(gaps) // 2]:.2f} us, "
              f"min {gaps[0]:.2f}, max {gaps[-1]:.2f}")
    between = sorted((b[0][0] - max(e for _, e, _, _ in a)) / 1000
                     for a, b in zip(replays, replays[1:]))
    if between:
        print(f"device idle between consecutive replays: median {between[len(between) // 2]:.1f} us, "
              f"min {between[0]:.1f}, max {between[-1]:.1f} (other launches may sit in it)")
        a, b = replays[-2], replays[-1]
        t0 = max(e for _, e, _, _ in a)
        t1 = b[0][0]
        print(f"inside the last gap ({(t1 - t0) / 1000:.1f} us), times from the end of the replay's last kernel:")
        shown = [o for o in other if t0 - 20_000 <= o[0] <= t1]
        for start, end, what, name in shown[:60]:
            kind = "copy" if what == "C" else "call"
            print(f"  {(start - t0) / 1000:9.1f} .. {(end - t0) / 1000:9.1f} us  {kind} {name}")
        if len(shown) > 60:
            print(f"  ... {len(shown) - 60} more")
        print(f"  {(t1 - t0) / 1000:9.1f} us  the next replay's first kernel")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    grid = None
    if "--by-grid" in args:
        i = args.index("--by-grid")
        grid = args[i + 1]
        del args[i:i + 2]
    sys.exit(main(args[0], grid))
