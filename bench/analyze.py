#!/usr/bin/env python3
"""analyze.py: turns the raw benchmark outputs into numbers and tables (stdlib only).

  analyze.py reaction ...      one reaction run -> one CSV line (called by reaction-one.sh)
  analyze.py reaction-table F  medians per (hog, rate, agent) of the runs in reaction CSV F
  analyze.py ticks LOG...      histogram / percentiles of gpuguard's `tick took_us=N` debug lines
"""
import argparse
import csv
import re
import statistics
import struct
import sys

FIELDS = ["agent", "rate", "hog", "fill_gibps", "start_mib", "floor_mib", "overshoot_mib", "halt_ms",
          "recovery_ms", "outcome", "acted"]


def rate_name(rate):
    rate = float(rate)
    return "max" if rate == 0 else f"{rate / 2**30:g} GiB/s"


def reaction(a):
    rows, hog = [], []
    with open(a.samples) as f:
        for r in csv.DictReader(f):
            if int(r["avail_kib"]) >= 0:
                rows.append((int(r["t_ns"]), int(r["avail_kib"]) * 1024))
                hog.append((int(r["t_ns"]), int(r["hog_bytes"])))
    with open(a.status, "rb") as f:
        held, last_growth, start_ns, capped, _pid = struct.unpack("<QqqiI", f.read(32))
    floor = a.floor
    cross = next((t for t, v in rows if v < floor), None)
    low = min(v for _, v in rows)
    overshoot = max(0, floor - low) / 2**20
    halt = recovery = fill = ""
    if cross is not None:
        # The hog's real fill rate over the 100 ms before the crossing.
        before = [(t, b) for t, b in hog if cross - 100_000_000 <= t <= cross]
        if len(before) > 1 and before[-1][0] > before[0][0]:
            fill = f"{(before[-1][1] - before[0][1]) / 2**30 / ((before[-1][0] - before[0][0]) / 1e9):.2f}"
        if not capped:
            halt = f"{(last_growth - cross) / 1e6:.1f}"
        back = next((t for t, v in rows if t > cross and v >= floor), None)
        if back is not None:
            recovery = f"{(back - cross) / 1e6:.1f}"
    rc = a.hog_rc
    outcome = {143: "SIGTERM", 137: "SIGKILL", 0: "capped"}.get(rc, f"rc={rc}")
    if capped and rc in (143, 137):
        outcome += "(after cap)"
    log = open(a.agent_log, errors="replace").read()
    # Did the agent say it acted on the hog? (gpuguard: "terminate/kill pid N(gg_bench_hog)";
    # earlyoom: 'sending SIGTERM to process N uid 0 "gg_bench_hog"')
    acted = "yes" if re.search(r"\b(terminate|kill) (model|pid) .*\(gg_bench_hog\)|sending SIG\w+ to process \d+ .*gg_bench_hog", log) else "no"
    w = csv.writer(sys.stdout)
    w.writerow([a.agent, a.rate, a.hog, fill, f"{a.start / 2**20:.0f}", f"{floor / 2**20:.0f}",
                f"{overshoot:.0f}", halt, recovery, outcome, acted])


def med(values):
    values = [float(v) for v in values if v != ""]
    return statistics.median(values) if values else None


def fmt(v, unit=""):
    return "—" if v is None else f"{v:.0f}{unit}" if abs(v) >= 10 else f"{v:.2f}{unit}" if abs(v) < 3 else f"{v:.1f}{unit}"


def reaction_table(a):
    with open(a.csv) as f:
        rows = [r for r in csv.DictReader(f, fieldnames=FIELDS) if r["agent"] != "agent"]
    # A run measures the agent only if the hog was still growing when MemAvailable crossed the
    # floor. On a shared host, memory freed or taken by others during a run can leave the floor
    # uncrossed (no fill rate) or crossed only after the hog had stopped at its cap (fill 0):
    # those runs are excluded and counted.
    excluded = {}
    valid = []
    for r in rows:
        if r["fill_gibps"] == "" or float(r["fill_gibps"]) < 0.05:
            k = (r["hog"], float(r["rate"]), r["agent"])
            excluded[k] = excluded.get(k, 0) + 1
        else:
            valid.append(r)
    rows = valid
    groups = {}
    for r in rows:
        groups.setdefault((r["hog"], float(r["rate"]), r["agent"]), []).append(r)
    order = {"gpuguard": 0, "earlyoom": 1, "earlyoom-kill": 2}
    print("| hog | rate | agent | runs (excluded) | fill GiB/s at crossing | halted | overshoot MiB (median) | halt ms (median) | recovery ms (median) | hog ended by |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted(groups, key=lambda k: (k[0] != "term", -k[1] if k[1] else -1e30, order.get(k[2], 9)))
    for hog, rate, agent in keys:
        g = groups[(hog, rate, agent)]
        halted = sum(1 for r in g if r["halt_ms"] != "")
        ends = {}
        for r in g:
            ends[r["outcome"]] = ends.get(r["outcome"], 0) + 1
        end = ", ".join(f"{k} x{v}" for k, v in sorted(ends.items()))
        print(f"| {hog} | {rate_name(rate)} | {agent} | {len(g)} ({excluded.get((hog, rate, agent), 0)}) | {fmt(med(r['fill_gibps'] for r in g))} | {halted}/{len(g)} | "
              f"{fmt(med(r['overshoot_mib'] for r in g))} | {fmt(med(r['halt_ms'] for r in g))} | "
              f"{fmt(med(r['recovery_ms'] for r in g))} | {end} |")
    # Target check: gpuguard's median overshoot and halt at most half of earlyoom's (default earlyoom).
    print()
    for hog in sorted({k[0] for k in keys}, key=lambda h: h != "term"):
        for rate in sorted({k[1] for k in keys if k[0] == hog}, key=lambda r: -r if r else -1e30):
            gg, eo = groups.get((hog, rate, "gpuguard")), groups.get((hog, rate, "earlyoom"))
            if not gg or not eo:
                continue
            for what, key in (("overshoot", "overshoot_mib"), ("halt", "halt_ms")):
                x, y = med(r[key] for r in gg), med(r[key] for r in eo)
                if x is None and y is None:
                    print(f"- {hog}, {rate_name(rate)}, {what}: neither agent halted the hog before its safety cap -> not measurable here (see recovery)")
                    continue
                if x is None or y is None:
                    verdict = f"gpuguard {fmt(x)} vs earlyoom {fmt(y)} (earlyoom never halted the hog)" if y is None and x is not None else f"gpuguard {fmt(x)} vs earlyoom {fmt(y)}"
                    ok = y is None and x is not None
                else:
                    ok = x <= y / 2
                    verdict = f"gpuguard {fmt(x)} vs earlyoom {fmt(y)}: ratio {x / y:.2f}" if y else f"gpuguard {fmt(x)} vs earlyoom {fmt(y)}"
                print(f"- {hog}, {rate_name(rate)}, {what}: {verdict} -> {'MET' if ok else 'MISSED'} (target <= 0.5)")


def ticks(a):
    pat = re.compile(r"took_us=(\d+) scan=(true|false)")
    for path in a.logs:
        vals = {"all": [], "true": [], "false": []}
        for line in open(path, errors="replace"):
            m = pat.search(line)
            if m:
                v = int(m.group(1))
                vals["all"].append(v)
                vals[m.group(2)].append(v)
        label = a.label or path
        print(f"{label}:")
        print("| ticks | scan | n | p50 µs | p90 µs | p99 µs | max µs |")
        print("|---|---|---|---|---|---|---|")
        for k, name in (("all", "all"), ("false", "no scan"), ("true", "scan")):
            v = sorted(vals[k])
            if not v:
                continue
            q = lambda p: v[min(len(v) - 1, int(p * len(v)))]
            print(f"| {label} | {name} | {len(v)} | {q(0.5)} | {q(0.9)} | {q(0.99)} | {v[-1]} |")
        v = vals["all"]
        if v:
            edges = [25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000]
            counts = [0] * (len(edges) + 1)
            for x in v:
                counts[next((i for i, e in enumerate(edges) if x < e), len(edges))] += 1
            print("\nhistogram of took_us:")
            lo = 0
            for i, c in enumerate(counts):
                hi = edges[i] if i < len(edges) else None
                rng = f"{lo}-{hi}" if hi else f">={lo}"
                print(f"  {rng:>12} µs {c:6d} {'#' * round(50 * c / len(v))}")
                lo = hi
        print()


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reaction")
    for k in ("samples", "status", "agent", "hog", "agent_log"):
        r.add_argument("--" + k.replace("_", "-"), required=True)
    for k in ("floor", "rate", "hog_rc", "start"):
        r.add_argument("--" + k.replace("_", "-"), type=int, required=True)
    t = sub.add_parser("reaction-table")
    t.add_argument("csv")
    k = sub.add_parser("ticks")
    k.add_argument("--label")
    k.add_argument("logs", nargs="+")
    a = p.parse_args()
    {"reaction": reaction, "reaction-table": reaction_table, "ticks": ticks}[a.cmd](a)


if __name__ == "__main__":
    main()
