"""The trainer's step under data parallelism: tokens/s per GPU for each way of exchanging the gradients.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 benchmarks/bench_ddp.py --batch 8 64 --json ddp2.json
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ddp.py --device cpu --preset smoke --batch 2  # gloo

Each rank runs --batch sequences of block_size tokens a micro-step (weak scaling: train.batch_size is
per GPU; the batches already on the device) through the trainer's own step
(``oelm_core.fast.make_step(..., ddp=True)``; on CUDA the CUDA-graph step, captured after 11 eager
steps) on the model as the trainer builds it (``oelm_core.fast.apply``), once for each --exchange:

    peer       train.grad_exchange: peer, the NVLink copies (oelm_core/fast/peer_grads.py): CUDA
               GPUs of one host with peer access only (elsewhere the row says why not, e.g.
               "here under gloo"); auto takes them on two GPUs, where they were measured
    ddp        DDP (train.grad_exchange: ddp)

An exchange may carry train.* settings of its own, to compare tuned DDP in one run:
``--exchange ddp ddp:ddp_bucket_mb=25 ddp:ddp_bucket_mb=100,compile=true``.

First, unless --no-baseline, the same step runs on rank 0 alone without DDP (one GPU, while the
others wait): efficiency = tokens/s per GPU over that one GPU's, in the same run, on the same
card. --set KEY=VALUE sets any other train.* switch for every row (e.g. --set compile=true
fused_logits=false). Rank 0 prints a table, with --markdown also the rows of a scaling table
(the runs of 1, 2 and 4 GPUs concatenate into one), and --json writes the rows with the
efficiency and the run's card, commit and world size; times are the median of --blocks blocks
of --steps steps after --warmup steps, the slowest rank's (CUDA events on GPUs).

    # a DDP scaling table: each run holds its own one-GPU baseline
    for n in 2 4; do torchrun --standalone --nproc_per_node $n benchmarks/bench_ddp.py --batch 8 16 64 \
        --exchange ddp --markdown --json ddp$n.json; done
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, card_name, commit, free_between_runs, median, now  # noqa: E402

from oelm_core import fast  # noqa: E402
from oelm_core.config import ConfigError, TrainConfig, model_config  # noqa: E402
from oelm_core.distributed import init_process_group, resolve_device  # noqa: E402
from oelm_core.model import build_model  # noqa: E402
from oelm_core.step import configure_optimizer  # noqa: E402

EXCHANGES = {"peer": {"grad_exchange": "peer"}, "ddp": {"grad_exchange": "ddp"}}


def exchange_spec(spec: str) -> tuple[str, dict]:
    """--exchange NAME[:KEY=VALUE,...] -> (NAME, its train.* settings); a SystemExit names what is wrong."""
    name, _, opts = spec.partition(":")
    if name not in EXCHANGES:
        raise SystemExit(
            f"bench_ddp: --exchange {spec!r}: expected one of {', '.join(EXCHANGES)}, "
            f"optionally with :KEY=VALUE,... train settings"
        )
    return name, train_settings(opts.split(",") if opts else [])


def train_settings(items: list[str]) -> dict:
    """--set KEY=VALUE items (train.* keys, the prefix optional; values as YAML) as a dict."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.removeprefix("train.")
        if not sep or key not in {f.name for f in dataclasses.fields(TrainConfig)}:
            raise SystemExit(f"bench_ddp: --set {item!r}: expected KEY=VALUE with a train.* key")
        out[key] = yaml.safe_load(value)
    return out


def time_step(args, tc: TrainConfig, group: str, batch: int, accum: int, device: torch.device, ddp: bool) -> dict:
    """Build the model, optimiser and step as the trainer does and time it: a result row.
    Collective when ``ddp``; otherwise this process alone. Call ``free_between_runs`` after it:
    no DDP reducer or captured graph may outlive the process group (destroying the group under
    one can hang at exit), and each row starts from the same memory."""
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base_mem = torch.cuda.memory_allocated(device) if cuda else 0  # held before this row: not its own
    cfg = model_config(args.preset, group)
    model = fast.apply(build_model(cfg, seed=0).to(device), tc)
    step = fast.make_step(model, configure_optimizer(model, tc, device), tc, device, ddp=ddp)
    rank = dist.get_rank() if ddp else 0
    gen = torch.Generator().manual_seed(rank + 1)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen) for _ in range(4)]
    batches = [(d[:, :-1].contiguous().to(device), d[:, 1:].contiguous().to(device)) for d in data]
    count = itertools.count(1)

    def one_step():
        i = next(count)
        step([batches[(i + m) % 4] for m in range(accum)], tc.lr, i)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        one_step()
    if cuda:
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - t0
    secs = []
    for _ in range(args.blocks):
        if ddp:
            dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            one_step()
        if cuda:
            end.record()
            end.synchronize()
            s = start.elapsed_time(end) / 1000 / args.steps
        else:
            s = (time.perf_counter() - t0) / args.steps
        t = torch.tensor(s, dtype=torch.float64, device=device)
        if ddp:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        secs.append(float(t))
    s = median(secs)
    world = dist.get_world_size() if ddp else 1
    tokens = world * accum * batch * cfg.block_size
    row = {
        "impl": "trainer",
        "reducer": step.gradients_by,
        "group": group,
        "world": world,
        "batch_per_gpu": batch,
        "grad_accum": accum,
        "block_size": cfg.block_size,
        "compile": tc.compile,
        "cuda_graph": tc.cuda_graph and cuda,
        "ms_per_step": 1000 * s,
        "tokens_per_s": tokens / s,
        "tokens_per_s_per_gpu": tokens / s / world,
        "warmup_s": warmup_s,
        "peak_mem_gb": (torch.cuda.max_memory_allocated(device) - base_mem) / 2**30 if cuda else None,
    }
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium512")
    ap.add_argument("--groups", nargs="+", default=["gpt_base"])
    ap.add_argument("--batch", type=at_least(1), nargs="+", default=[8, 64], help="sequences per GPU a micro-step")
    ap.add_argument(
        "--grad-accum",
        type=at_least(1),
        nargs="+",
        default=[1],
        help="micro-steps a step (train.grad_accum); the gradients cross once a step",
    )
    ap.add_argument(
        "--exchange",
        nargs="+",
        default=list(EXCHANGES),
        metavar="NAME[:KEY=VALUE,...]",
        help=f"{', '.join(EXCHANGES)}, each optionally with train settings of its own, e.g. ddp:ddp_bucket_mb=100",
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-GPU step on rank 0")
    ap.add_argument(
        "--set",
        dest="sets",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="other train.* settings for every row, e.g. compile=true cuda_graph=false",
    )
    ap.add_argument("--device", default="auto", help="train.device: auto, cpu or cuda")
    ap.add_argument("--steps", type=at_least(1), default=10)
    ap.add_argument("--blocks", type=at_least(1), default=5)
    ap.add_argument(
        "--warmup",
        type=at_least(0),
        default=15,
        help="steps before timing (the CUDA graph is captured after 11 under DDP)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="also print the rows as a markdown table")
    args = ap.parse_args()
    settings = {"compile": False, **train_settings(args.sets)}  # eager unless --set compile=true
    exchanges = [(spec, *exchange_spec(spec)) for spec in args.exchange]

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = resolve_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as the trainer
    rows = []
    for group, batch, accum in itertools.product(args.groups, args.batch, args.grad_accum):
        if not args.no_baseline:
            if rank == 0:
                tc = TrainConfig(**settings)
                rows.append({"exchange": "one GPU", **time_step(args, tc, group, batch, accum, device, ddp=False)})
                free_between_runs(cuda=device.type == "cuda")
            dist.barrier()
        for spec, name, own in exchanges if world > 1 else ():
            tc = TrainConfig(**{**settings, **own, **EXCHANGES[name]})
            try:
                row = {"exchange": spec, **time_step(args, tc, group, batch, accum, device, ddp=True)}
            except ConfigError as exc:  # every rank alike: peer where it cannot run
                row = {
                    "exchange": spec,
                    "group": group,
                    "batch_per_gpu": batch,
                    "grad_accum": accum,
                    "world": world,
                    "unavailable": str(exc),
                }
            free_between_runs(cuda=device.type == "cuda")
            rows.append(row)
    if rank == 0:
        report(args, rows, settings, device, world)
    dist.destroy_process_group()


def report(args, rows: list[dict], settings: dict, device: torch.device, world: int) -> None:
    """Rank 0: the table, the markdown rows (--markdown) and the JSON file (--json). Each timed
    row gains its efficiency: tokens/s per GPU over the one-GPU baseline's of the same group,
    batch and accumulation (None without one)."""
    one = {
        (r["group"], r["batch_per_gpu"], r["grad_accum"]): r["tokens_per_s"] for r in rows if r["exchange"] == "one GPU"
    }
    for r in rows:
        if "unavailable" not in r:
            base = one.get((r["group"], r["batch_per_gpu"], r["grad_accum"]))
            r["baseline_tokens_per_s"] = base
            r["efficiency"] = r["tokens_per_s_per_gpu"] / base if base else None
    meta = {
        "card": card_name(device),
        "date": now(),
        "commit": commit(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "world": world,
        "preset": args.preset,
        "train": settings,
    }
    print(
        f"\n{meta['card']} x{world}, {args.preset}, {meta['date']}, commit {meta['commit']}"
        + (f", train {settings}" if settings else "")
    )
    print(
        f"{'group':12s} {'batch/GPU':>9s} {'accum':>5s}  {'exchange':10s} {'ms/step':>8s} "
        f"{'tok/s/GPU':>10s} {'efficiency':>10s} {'peak GB':>8s}  gradients by"
    )
    for r in rows:
        head = f"{r['group']:12s} {r['batch_per_gpu']:9d} {r['grad_accum']:5d}  {r['exchange']:10s}"
        if "unavailable" in r:
            print(f"{head} unavailable: {r['unavailable']}")
            continue
        eff = f"{100 * r['efficiency']:9.1f}%" if r["efficiency"] else f"{'-':>10s}"
        mem = f"{r['peak_mem_gb']:8.2f}" if r["peak_mem_gb"] is not None else f"{'-':>8s}"
        print(f"{head} {r['ms_per_step']:8.2f} {r['tokens_per_s_per_gpu']:10.0f} {eff} {mem}  {r['reducer']}")
    if args.markdown:
        print(markdown(rows, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "meta": meta,
                    "results": [r for r in rows if "unavailable" not in r],
                    "unavailable": [r for r in rows if "unavailable" in r],
                },
                f,
                indent=1,
            )


def markdown(rows: list[dict], meta: dict) -> str:
    """The timed rows as a markdown scaling table: a one-GPU baseline row counts one GPU."""
    lines = [
        "| card | GPUs | batch/GPU x tokens | accum | exchange | compile | ms/step | tokens/s per GPU "
        "| tokens/s | efficiency | commit |",
        "|---" * 11 + "|",
    ]
    for r in rows:
        if "unavailable" in r:
            continue
        gpus = 1 if r["exchange"] == "one GPU" else r["world"]
        eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] else "-"
        lines.append(
            f"| {meta['card']} | {gpus} | {r['batch_per_gpu']} x {r['block_size']} | {r['grad_accum']} "
            f"| {r['exchange']} | {'yes' if r['compile'] else 'no'} | {r['ms_per_step']:.2f} "
            f"| {r['tokens_per_s_per_gpu']:,.0f} | {r['tokens_per_s']:,.0f} | {eff} | {meta['commit']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
