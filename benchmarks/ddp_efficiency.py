"""Join bench_ddp.py's JSON files (world 1 and world N) into the efficiency table of RESULTS.md.

    python3 benchmarks/ddp_efficiency.py out_ddp/ddp_*.json
"""
import sys

from make_results import ddp_table

print(ddp_table(sys.argv[1:]))
