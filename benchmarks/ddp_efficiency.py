"""Join bench_ddp.py's JSON files (world 1 and world N) into an efficiency table."""
import json
import sys

rows = []
for path in sys.argv[1:]:
    rows += json.load(open(path))["results"]
one = {(r.get("impl"), r["group"], r["batch_per_gpu"]): r["tokens_per_s"] for r in rows if r["world"] == 1}
print(f"{'impl':8s} {'group':14s} {'batch/GPU':>9s} {'world':>5s} {'tok/s':>10s} {'efficiency':>10s}")
for r in rows:
    base = one.get((r.get("impl"), r["group"], r["batch_per_gpu"]))
    eff = r["tokens_per_s"] / (r["world"] * base) if base else float("nan")
    print(f"{r.get('impl', '-'):8s} {r['group']:14s} {r['batch_per_gpu']:9d} {r['world']:5d} {r['tokens_per_s']:10.0f} {100 * eff:9.1f}%")
