#!/usr/bin/env python3
"""analyze.py: turns the raw benchmark outputs into numbers and tables (stdlib only).

  analyze.py reaction ...      one reaction run -> one CSV line (called by reaction-one.sh)
  analyze.py reaction-table F  medians per (hog, rate, agent) of the runs in reaction CSV F
  analyze.py ticks LOG...      histogram / percentiles of gpuguard's `tick took_us=N` debug lines
                               (and of the scan thread's `scan took_us=N` lines)
  analyze.py hot-code ...      the functions on the resident text pages of a running binary
                               (bench/hot-code.sh), in address order
  analyze.py hot-code-check .. how many functions of an order file a binary has
"""
import argparse
import csv
import re
import statistics
import struct
import subprocess
import sys

FIELDS = ["agent", "rate", "hog", "fill_gibps", "start_mib", "floor_mib", "overshoot_mib", "halt_ms",
          "recovery_ms", "outcome", "acted", "background"]
BACKGROUNDS = {"none": 0, "idle1000": 1, "storm": 2}


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
                f"{overshoot:.0f}", halt, recovery, outcome, acted, a.background])


def med(values):
    values = [float(v) for v in values if v != ""]
    return statistics.median(values) if values else None


def fmt(v, unit=""):
    return "—" if v is None else f"{v:.0f}{unit}" if abs(v) >= 10 else f"{v:.2f}{unit}" if abs(v) < 3 else f"{v:.1f}{unit}"


def reaction_table(a):
    with open(a.csv) as f:
        rows = [r for r in csv.DictReader(f, fieldnames=FIELDS) if r["agent"] != "agent"]
    for r in rows:
        r["background"] = r.get("background") or "none"  # CSVs from before the column
    # A run measures the agent only if the hog was still growing when MemAvailable crossed the
    # floor. On a shared host, memory freed or taken by others during a run can leave the floor
    # uncrossed (no fill rate) or crossed only after the hog had stopped at its cap (fill 0):
    # those runs are excluded and counted.
    key = lambda r: (r["background"], r["hog"], float(r["rate"]), r["agent"])
    excluded = {}
    groups = {}
    for r in rows:
        if r["fill_gibps"] == "" or float(r["fill_gibps"]) < 0.05:
            excluded[key(r)] = excluded.get(key(r), 0) + 1
        else:
            groups.setdefault(key(r), []).append(r)
    order = {"gpuguard": 0, "earlyoom": 1, "earlyoom-kill": 2}
    print("| background | hog | rate | agent | runs (excluded) | fill GiB/s at crossing | halted | overshoot MiB (median) | halt ms (median) | recovery ms (median) | hog ended by |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted(set(groups) | set(excluded), key=lambda k: (BACKGROUNDS.get(k[0], 9), k[1] != "term", -k[2] if k[2] else -1e30, order.get(k[3], 9)))
    for k in keys:
        g = groups.get(k, [])
        background, hog, rate, agent = k
        halted = sum(1 for r in g if r["halt_ms"] != "")
        ends = {}
        for r in g:
            ends[r["outcome"]] = ends.get(r["outcome"], 0) + 1
        end = ", ".join(f"{e} x{v}" for e, v in sorted(ends.items()))
        print(f"| {background} | {hog} | {rate_name(rate)} | {agent} | {len(g)} ({excluded.get(k, 0)}) | {fmt(med(r['fill_gibps'] for r in g))} | {halted}/{len(g)} | "
              f"{fmt(med(r['overshoot_mib'] for r in g))} | {fmt(med(r['halt_ms'] for r in g))} | "
              f"{fmt(med(r['recovery_ms'] for r in g))} | {end} |")
    # Targets (issue 15): a SIGTERM-able hog: gpuguard's median overshoot and halt at most half
    # of earlyoom's (its default); a hog ignoring SIGTERM: at most those of `earlyoom -M F,F`
    # (earlyoom-kill), which SIGKILLs at the floor.
    print()
    cases = sorted({k[:3] for k in groups}, key=lambda c: (BACKGROUNDS.get(c[0], 9), c[1] != "term", -c[2] if c[2] else -1e30))
    for background, hog, rate in cases:
        gg = groups.get((background, hog, rate, "gpuguard"))
        for other, limit in (("earlyoom", 0.5), ("earlyoom-kill", 1.0)):
            if hog == "ignore-term" and other == "earlyoom":
                continue  # default earlyoom never SIGKILLs such a hog before its cap (see the table)
            eo = groups.get((background, hog, rate, other))
            if not gg or not eo:
                continue
            for what, col in (("overshoot", "overshoot_mib"), ("halt", "halt_ms")):
                x, y = med(r[col] for r in gg), med(r[col] for r in eo)
                label = f"- {background}, {hog}, {rate_name(rate)}, {what} vs {other}"
                if x is None or y is None:
                    ok = x is not None
                    print(f"{label}: gpuguard {fmt(x)} vs {fmt(y)} -> {'MET' if ok else 'MISSED'} (target <= {limit}x)")
                    continue
                ok = x <= y * limit
                ratio = f"ratio {x / y:.2f}" if y else "ratio -"
                print(f"{label}: gpuguard {fmt(x)} vs {fmt(y)}: {ratio} -> {'MET' if ok else 'MISSED'} (target <= {limit}x)")
    # During a fork storm, gpuguard should react as on a quiet host.
    for hog, rate in sorted({(k[1], k[2]) for k in groups}):
        quiet, storm = groups.get(("none", hog, rate, "gpuguard")), groups.get(("storm", hog, rate, "gpuguard"))
        if quiet and storm:
            print(f"- gpuguard, {hog}, {rate_name(rate)}: halt {fmt(med(r['halt_ms'] for r in quiet))} ms quiet vs "
                  f"{fmt(med(r['halt_ms'] for r in storm))} ms in a fork storm; overshoot "
                  f"{fmt(med(r['overshoot_mib'] for r in quiet))} vs {fmt(med(r['overshoot_mib'] for r in storm))} MiB")


def percentiles(label, name, v):
    v = sorted(v)
    if not v:
        return
    q = lambda p: v[min(len(v) - 1, int(p * len(v)))]
    print(f"| {label} | {name} | {len(v)} | {q(0.5)} | {q(0.9)} | {q(0.99)} | {v[-1]} |")


def ticks(a):
    pat = re.compile(r"tick took_us=(\d+) scan=(true|false)")
    scan_pat = re.compile(r"scan took_us=(\d+) listed=(\d+) new=(\d+) refreshed=(\d+).* full=(true|false)")
    for path in a.logs:
        vals = {"all": [], "true": [], "false": []}
        scans = {"true": [], "false": []}
        listed, new, refreshed = [], [], []
        for line in open(path, errors="replace"):
            m = pat.search(line)
            if m:
                v = int(m.group(1))
                vals["all"].append(v)
                vals[m.group(2)].append(v)
                continue
            m = scan_pat.search(line)
            if m:
                scans[m.group(5)].append(int(m.group(1)))
                listed.append(int(m.group(2)))
                new.append(int(m.group(3)))
                refreshed.append(int(m.group(4)))
        label = a.label or path
        print(f"{label}:")
        print("| ticks | scan | n | p50 µs | p90 µs | p99 µs | max µs |")
        print("|---|---|---|---|---|---|---|")
        for k, name in (("all", "all"), ("false", "no new table"), ("true", "new table merged")):
            percentiles(label, name, vals[k])
        if scans["true"] or scans["false"]:
            print("\nscan rounds on the scan thread (not in the tick):")
            print("| rounds | kind | n | p50 µs | p90 µs | p99 µs | max µs |")
            print("|---|---|---|---|---|---|---|")
            percentiles(label, "partial", scans["false"])
            percentiles(label, "full", scans["true"])
            mean = lambda x: sum(x) / len(x) if x else 0
            print(f"\nper round (mean): {mean(listed):.0f} pids listed, {mean(new):.1f} new, {mean(refreshed):.1f} re-read")
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


def text_section(binary):
    """(address, file offset, size) of BINARY's .text."""
    out = subprocess.run(["readelf", "-SW", binary], capture_output=True, text=True, check=True).stdout
    m = re.search(r"\]\s+\.text\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", out)
    return tuple(int(x, 16) for x in m.groups())


def functions(binary):
    """(address, size, mangled name) of BINARY's function symbols."""
    out = subprocess.run(["nm", "-S", "--defined-only", binary], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        p = line.split()
        if len(p) == 4 and p[2] in "tTwW" and int(p[1], 16):
            yield int(p[0], 16), int(p[1], 16), p[3]


def hot_code(a):
    page = 4096
    addr, offset, size = text_section(a.binary)
    name = a.binary.rsplit("/", 1)[-1]
    hot = set()  # resident pages of .text, as link-time addresses // page
    with open(f"/proc/{a.pid}/pagemap", "rb") as pagemap:
        for line in open(f"/proc/{a.pid}/maps"):
            p = line.split()
            if len(p) < 6 or p[5].rsplit("/", 1)[-1] != name:
                continue
            lo, hi = (int(x, 16) for x in p[0].split("-"))
            map_offset = int(p[2], 16)
            for va in range(lo, hi, page):
                pagemap.seek(va // page * 8)
                present = struct.unpack("<Q", pagemap.read(8))[0] >> 63
                file_offset = map_offset + va - lo
                if present and offset <= file_offset < offset + size:
                    hot.add((file_offset - offset + addr) // page)
    listed = total = 0
    for start, length, symbol in sorted(functions(a.binary)):
        if any(pg in hot for pg in range(start // page, (start + length - 1) // page + 1)):
            print(symbol)
            listed += 1
            total += length
    print(f"{len(hot)} resident pages of text ({len(hot) * page / 2**20:.1f} MiB); "
          f"{listed} functions on them, {total / 2**20:.1f} MiB", file=sys.stderr)


def hot_code_check(a):
    """How many listed functions BINARY has; with --require-applied, exit 1 unless those it has
    open its .text in the list's order (the linker applied the order: build.rs). A list none of
    whose names the binary has (another compiler) is stale, not a failure: it says so."""
    addresses = {symbol: start for start, _, symbol in functions(a.binary)}
    order = [line.strip() for line in open(a.order) if line.strip()]
    found = [addresses[symbol] for symbol in order if symbol in addresses]
    print(f"{a.binary}: {len(found)} of the {len(order)} functions listed in {a.order} "
          f"({100 * len(found) / max(len(order), 1):.0f} %)")
    if not found:
        print("the list is stale for this build (another compiler or dependency versions): "
              "rerun bench/hot-code.sh")
    elif a.require_applied:
        text_start = text_section(a.binary)[0]
        if found != sorted(found) or min(found) > text_start + 4096:
            print("the listed functions do not open .text in the list's order: "
                  "the order was not applied", file=sys.stderr)
            sys.exit(1)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reaction")
    for k in ("samples", "status", "agent", "hog", "agent_log"):
        r.add_argument("--" + k.replace("_", "-"), required=True)
    r.add_argument("--background", default="none")
    for k in ("floor", "rate", "hog_rc", "start"):
        r.add_argument("--" + k.replace("_", "-"), type=int, required=True)
    t = sub.add_parser("reaction-table")
    t.add_argument("csv")
    k = sub.add_parser("ticks")
    k.add_argument("--label")
    k.add_argument("logs", nargs="+")
    h = sub.add_parser("hot-code")
    h.add_argument("--pid", required=True)
    h.add_argument("--binary", required=True)
    c = sub.add_parser("hot-code-check")
    c.add_argument("--binary", required=True)
    c.add_argument("--order", required=True)
    c.add_argument("--require-applied", action="store_true")
    a = p.parse_args()
    {"reaction": reaction, "reaction-table": reaction_table, "ticks": ticks, "hot-code": hot_code,
     "hot-code-check": hot_code_check}[a.cmd](a)


if __name__ == "__main__":
    main()
