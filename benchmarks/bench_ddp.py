"""DDP scaling: tokens/s of one training step per GPU, 1 -> N GPUs (one process each, NCCL).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/bench_ddp.py --batch 8 64 --json out.json

Each rank runs --batch sequences of block_size tokens per step (weak scaling, as the trainer's
batch_size is per GPU). --impl trainer (the default) times what oelm_core.train runs: on one GPU
its plain step (no DDP: one process has nothing to reduce), on N its step with ddp=True, the
compiled model inside DistributedDataParallel (the tied embedding/output weight reduced by
oelm_core.train.TiedGradReducer instead), forward + backward + all-reduce + clip + fused AdamW
captured as one CUDA graph after 11 eager steps; on two GPUs of one host with peer access its
gradients go by NVLink copies instead of DDP (oelm_core.peer_grads; --grad-exchange ddp auto
times both in one run). --impl tuned wraps DDP first (also on one GPU;
gradient_as_bucket_view, static_graph, --bucket-mb), compiles that and runs without a graph.
Rank 0 prints the global tokens/s (median of --blocks blocks after warm-up, timed with CUDA
events and a barrier) and the peak memory above what was allocated before the row began. CUDA
only. Run it once with --nproc_per_node 1 and once with N; efficiency =
tok/s(N) / (N x tok/s(1)), what N GPUs give over one (benchmarks/ddp_efficiency.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PlainStep, at_least, card_name, commit, free_between_runs, median, now  # noqa: E402

from oelm_core.accounting import flops_per_token, peak_flops  # noqa: E402
from oelm_core.config import GRAD_EXCHANGES, TrainConfig, model_config  # noqa: E402
from oelm_core.model import GPT  # noqa: E402
from oelm_core.train import DDP_NO_BUFFER_SYNC, configure_optimizer, make_step  # noqa: E402


def make_ddp_step(args, cfg, batch: int, device: torch.device, exchange: str = "auto",
                  accum: int = 1):
    """step(x, y) -> loss for one model of ``cfg`` under DDP, as --impl says; step.warmup(x, y, n);
    step.reducer: what reduced the gradients. With ``accum`` > 1 (--impl trainer) one step is that
    many micro-steps on (x, y), the gradients exchanged once, after the last."""
    model = GPT(cfg).to(device)
    tc = TrainConfig(compile=args.compile_mode != "none", grad_exchange=exchange)
    if args.impl == "tuned":
        ddp = DDP(model, device_ids=[device.index], gradient_as_bucket_view=True, static_graph=True,
                  bucket_cap_mb=args.bucket_mb, **DDP_NO_BUFFER_SYNC)
        fwd = ddp if args.compile_mode == "none" else torch.compile(
            ddp, **({} if args.compile_mode == "default" else {"mode": args.compile_mode}))
        step = PlainStep(model, fwd, tc, (batch, cfg.block_size), device)
        step.reducer = "ddp (tuned)"
        return step
    # oelm_core.train's own step, with DDP where the trainer uses it (more than one process).
    tstep = make_step(model, configure_optimizer(model, tc, device), tc, device,
                      ddp=dist.get_world_size() > 1)
    count = [0]

    def step(x, y):
        count[0] += 1
        batch_on_device = (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        return tstep([batch_on_device] * accum, tc.lr, count[0])[0]
    step.warmup = lambda x, y, n=3: [step(x, y) for _ in range(n)]
    step.reducer = tstep.gradients_by
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium512")
    ap.add_argument("--groups", nargs="+", default=["gpt_base"])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--steps", type=at_least(1), default=10)
    ap.add_argument("--blocks", type=at_least(1), default=5)
    ap.add_argument("--warmup", type=at_least(0), default=10)
    ap.add_argument("--compile-mode", default="default")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--impl", default="trainer", choices=["trainer", "tuned"],
                    help="trainer: oelm_core.train's step (ddp=True, CUDA graph); tuned: DDP with "
                         "gradient_as_bucket_view, static_graph and --bucket-mb, then torch.compile")
    ap.add_argument("--grad-exchange", nargs="+", default=[TrainConfig.grad_exchange], choices=GRAD_EXCHANGES,
                    help="--impl trainer: train.grad_exchange, each in turn")
    ap.add_argument("--grad-accum", type=int, nargs="+", default=[1],
                    help="--impl trainer: micro-steps per optimiser step (train.grad_accum), each in "
                         "turn; the gradients cross between GPUs once a step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.impl == "tuned" and args.grad_accum != [1]:
        ap.error("--grad-accum is for --impl trainer")
    if not torch.cuda.is_available():
        print("bench_ddp: needs CUDA (one GPU per process, NCCL); there is no CUDA device here. Nothing to do.")
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for group, batch, exchange, accum in itertools.product(args.groups, args.batch, args.grad_exchange,
                                                           args.grad_accum):
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats(device)
        base_mem = torch.cuda.memory_allocated(device)  # held before this row began: not its own
        cfg = model_config(args.preset, group)
        step = make_ddp_step(args, cfg, batch, device, exchange, accum)
        gen = torch.Generator().manual_seed(rank + 1)
        data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen) for _ in range(4)]
        xs = [d[:, :-1].contiguous().pin_memory() for d in data]
        ys = [d[:, 1:].contiguous().pin_memory() for d in data]
        t0 = time.perf_counter()
        step.warmup(xs[0], ys[0], n=3)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        for i in range(args.warmup):
            step(xs[i % 4], ys[i % 4])
        secs = []
        for _ in range(args.blocks):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(args.steps):
                step(xs[i % 4], ys[i % 4])
            end.record()
            end.synchronize()
            t = torch.tensor(start.elapsed_time(end) / 1000 / args.steps, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            secs.append(float(t))
        s = median(secs)
        tokens = world * accum * batch * cfg.block_size
        peak = peak_flops(device)
        row = {"impl": args.impl, "reducer": step.reducer, "group": group, "world": world,
               "batch_per_gpu": batch, "grad_accum": accum, "ms_per_step": 1000 * s, "tokens_per_s": tokens / s, "tokens_per_s_per_gpu": tokens / s / world,
               "mfu": tokens / s / world * flops_per_token(cfg)["total"] / peak if peak else None,
               "compile_s": compile_s, "peak_mem_gb": (torch.cuda.max_memory_allocated(device) - base_mem) / 2**30}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        # step and step.warmup form a cycle: collect it, so that no DDP reducer or captured
        # graph outlives the process group (destroying the group under one can hang at exit).
        del step
        free_between_runs(cuda=True)
    if rank == 0:
        meta = {"card": card_name(), "date": now(), "commit": commit(), "torch": torch.__version__,
                "command": " ".join(sys.argv), "world": world}
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": rows}, f, indent=1)
        print(f"\n{meta['card']} x{world}  {meta['date']}")
        for r in rows:
            print(f"{r['group']:14s} world {r['world']} batch/GPU {r['batch_per_gpu']:3d} x{r['grad_accum']}: "
                  f"{r['tokens_per_s']:10.0f} tok/s  {r['ms_per_step']:7.2f} ms/step  ({r['reducer']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
