#!/usr/bin/env python3
"""Reads bench/run.sh's JSON lines on stdin and prints, per benchmark and figure,
the median with min and max over the measured rounds, as a Markdown table."""
import json
import statistics
import sys

rows = {}
order = []
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        if line:
            print(line)
        continue
    rec = json.loads(line)
    name = rec["bench"]
    if name not in rows:
        rows[name] = {}
        order.append(name)
    for key, value in (rec.get("result") or {}).items():
        if isinstance(value, bool):
            # A check (B6's text_ok): shown as the rounds it held in.
            rows[name].setdefault(key, []).append(value)
        elif isinstance(value, (int, float)):
            rows[name].setdefault(key, []).append(value)


def fmt(v):
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


print("| benchmark | figure | median | min | max | runs |")
print("|---|---|---|---|---|---|")
for name in order:
    for key, values in rows[name].items():
        if all(isinstance(v, bool) for v in values):
            held = f"{sum(values)}/{len(values)}"
            print(f"| {name} | {key} | {held} | | | {len(values)} |")
            continue
        print(f"| {name} | {key} | {fmt(statistics.median(values))} | {fmt(min(values))} | {fmt(max(values))} | {len(values)} |")
