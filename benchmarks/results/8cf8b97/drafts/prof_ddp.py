"""Scratch: the trainer's step at 8 x 512 per GPU, variants of the NVLink exchange alternated on one
start (ms per step, median of blocks), and a profiler listing of one replayed step per variant.

torchrun --nproc_per_node N .device/prof_ddp.py --variants early late --out DIR
"""
import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import bench_ddp  # noqa: E402
import oelm_core.train as train  # noqa: E402
from oelm_core.config import model_config  # noqa: E402
from oelm_core.peer_grads import PeerGradExchange  # noqa: E402


class Late(PeerGradExchange):
    """The exchange before this change: the output shares added after the backward."""

    def _on_output_grad(self, grad):
        self._out = grad if self._out is None else self._out.add_(grad)
        if self.sync and self._ids is not None:
            self._send(self._peer_out, self._out)
            self._late = True

    def _barrier(self, channel):
        super()._barrier(channel)
        if channel == 0 and getattr(self, "_late", False):
            self._late = False
            self._out.add_(self._recv_out.view_as(self._out))


class Old(Late):
    """1dcef5c: the output shares added after the backward, the ids sorted before the forward."""

    def begin(self, tokens):
        self._aside = nullcontext
        try:
            super().begin(tokens)
        finally:
            del self._aside


class BodyEarly(PeerGradExchange):
    """The body's sums too during the backward: group by group (~GROUP_MB of gradients each, by
    slot, the same groups on both ranks whatever order the backward sends them in), once both
    ranks' copies of a group have left / landed, on the side stream, *into the receive buffer*,
    which then becomes ``.grad`` (autograd owns the gradients' memory until the backward returns).
    The barrier that kept the peer from writing a receive buffer before it was read moves from the
    end of ``finish`` to the next step's ``begin``: after this rank's optimizer step has read it."""

    GROUP_MB = 12

    def __init__(self, model, device):
        super().__init__(model, device)
        self._groups, members, size = [], [], 0
        for i, p in enumerate(self.params):
            members.append(i)
            size += 4 * p.numel()
            if size >= self.GROUP_MB * 2**20:
                self._groups.append(members)
                members, size = [], 0
        if members:
            self._groups.append(members)
        self._group_of = {i: g for g, m in enumerate(self._groups) for i in m}
        self._mine = [None] * len(self.params)

    def begin(self, tokens):
        self._barrier(1)  # the peer's optimizer step has read what this rank wrote last step
        self._left = [len(m) for m in self._groups]
        super().begin(tokens)

    def _on_grad(self, slot, grad):
        if not self.sync:
            return
        self._sent[slot] += 1
        earlier = self.params[slot].grad
        src = grad if earlier is None else grad + earlier
        self._send(self._peer_slots[slot], src)
        self._mine[slot] = src.new_empty(0).set_(src.untyped_storage(), src.storage_offset(),
                                                 src.shape, src.stride())
        g = self._group_of[slot]
        self._left[g] -= 1
        if self._left[g] == 0:
            recv = [self._recv_slots[i] for i in self._groups[g]]
            mine = [self._mine[i] for i in self._groups[g]]
            self._after_peer(3 + g, lambda: torch._foreach_add_(recv, mine))

    def finish(self):
        assert self._sent == [1] * len(self.params)
        if self.tied is not None and self._ids is None:
            self._out.add_(self.tied.grad)
            self._send(self._peer_out, self._out)
        self._join()
        self._barrier(0)
        for p, r in zip(self.params, self._recv_slots):
            p.grad = r
        if self.tied is not None:
            out = self._out
            if self._ids is None:
                out.add_(self._recv_out.view_as(out))
            else:
                n = self._ids.numel()
                ids = {self.rank: self._ids, 1 - self.rank: self._recv_ids[:n]}
                peer_rows = self._recv_rows[: self._rows.numel()].view_as(self._rows)
                rows = {self.rank: self._rows, 1 - self.rank: peer_rows}
                for r in (0, 1):
                    out.index_add_(0, ids[r], rows[r])
            self.tied.grad = out
        self._out = self._ids = self._first = self._rows = None
        self._mine = [None] * len(self.params)


class NoMask(PeerGradExchange):
    """The embedding's rows gathered without the mask's multiply: a repeated id gathers a zero
    padding row instead (its embedding gradient is 0: no token has that id). Needs
    padded_vocab > vocab (medium512: 50,304 > 50,257)."""

    def begin(self, tokens):
        super().begin(tokens)
        if self._ids is not None:
            with self._aside():
                self._gather = torch.where(self._first, self._ids, self.tied.size(0) - 1)

    def _on_embedding_grad(self, weight):
        if self.sync and self._ids is not None:
            self._rejoin()
            self._rows = weight.grad[self._gather]
            self._send(self._peer_rows[: self._rows.numel()], self._rows)


class Both(NoMask, BodyEarly):
    pass


VARIANTS = {"early": PeerGradExchange, "late": Late, "old": Old, "body": BodyEarly,
            "nomask": NoMask, "both": Both}


def build(batch, variant, device):
    train.PeerGradExchange = VARIANTS.get(variant, PeerGradExchange)
    args = SimpleNamespace(compile_mode="default", impl="trainer", bucket_mb=25.0)
    cfg = model_config("medium512", "gpt_base")
    torch.manual_seed(0)
    step = bench_ddp.make_ddp_step(args, cfg, batch, device, "auto", 1)
    train.PeerGradExchange = PeerGradExchange
    return step, cfg


def timed(step, xs, ys, blocks=5, steps=10):
    out = []
    for _ in range(blocks):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(steps):
            step(xs[i % 4], ys[i % 4])
        b.record()
        b.synchronize()
        t = torch.tensor(a.elapsed_time(b) / steps, device=xs[0].device if xs[0].is_cuda else "cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return sorted(out)[len(out) // 2], out


def listing(trace_path, rank, name, out_dir):
    with open(trace_path) as f:
        ev = json.load(f)["traceEvents"]
    dev = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    groups = defaultdict(list)
    for e in dev:
        groups[e.get("args", {}).get("correlation", -1)].append(e)
    steps = [g for g in groups.values() if len(g) > 40]
    steps.sort(key=lambda g: min(e["ts"] for e in g))
    lines = [f"{name} rank {rank}: {len(steps)} replays found"]
    for gi, g in enumerate(steps):
        g.sort(key=lambda e: e["ts"])
        t0 = g[0]["ts"]
        t1 = max(e["ts"] + e["dur"] for e in g)
        lines.append(f"replay {gi}: span {t1 - t0:.1f} us, {len(g)} events")
    if len(steps) < 3:  # no grouping by launch: the last events as they come
        steps = [[], [], sorted(dev, key=lambda e: e["ts"])[-600:]]
    if len(steps) >= 3:
        g = steps[2]
        t0 = g[0]["ts"]
        for e in g:
            lines.append(f"{e['ts'] - t0:9.1f} {e['dur']:8.1f} s{e.get('tid')} {e['name'][:90]}")
    with open(os.path.join(out_dir, f"list_{name}_r{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["early", "late"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", nargs="*", default=None, help="variants to profile (default: all)")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    steps = {}
    for v in a.variants:
        t = time.perf_counter()
        step, cfg = build(a.batch, v, device)
        gen = torch.Generator().manual_seed(rank + 1)
        data = [torch.randint(0, cfg.vocab_size, (a.batch, cfg.block_size + 1), generator=gen) for _ in range(4)]
        xs = [d[:, :-1].contiguous().pin_memory() for d in data]
        ys = [d[:, 1:].contiguous().pin_memory() for d in data]
        losses = [float(step(xs[i % 4], ys[i % 4])) for i in range(20)]
        torch.cuda.synchronize()
        if rank == 0:
            print(f"{v}: losses {losses[0]:.6f} .. {losses[-1]:.6f}  {losses}", flush=True)
        steps[v] = (step, xs, ys)
        if rank == 0:
            print(f"{v}: built+warm {time.perf_counter() - t:.1f} s, by {step.reducer}", flush=True)
    results = defaultdict(list)
    for r in range(a.rounds):
        for v in a.variants:
            med, all_ = timed(*steps[v])
            results[v].append(med)
            if rank == 0:
                print(f"round {r} {v}: {med:.4f} ms  blocks {' '.join(f'{x:.4f}' for x in all_)}", flush=True)
    if rank == 0:
        for v in a.variants:
            print(f"{v} world {world} batch {a.batch}: median of rounds {sorted(results[v])[len(results[v]) // 2]:.4f} ms  rounds {results[v]}")
    for v in a.variants if a.profile is None else a.profile:
        step, xs, ys = steps[v]
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(6):
                step(xs[i % 4], ys[i % 4])
            torch.cuda.synchronize()
        path = os.path.join(a.out, f"trace_{v}_r{rank}.json")
        prof.export_chrome_trace(path)
        listing(path, rank, v, a.out)
        os.remove(path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
