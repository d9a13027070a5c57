"""Scratch (2026-11-26, eleventh stop): every body gradient all-reduced in place by an op *inside*
the compiled backward, launched right after the kernel that wrote it (no DDP, no bucket copies),
against the trainer's DDP step. torchrun --nproc_per_node 2 ingraph.py base op op_mat plain

op:     an identity on every body parameter (torch parametrize) whose backward calls a custom op
        that starts dist.all_reduce(grad, AVG, async_op=True) on NCCL's stream, right after the
        kernel that wrote the gradient; the step waits for all of them after the backward pass.
        The tied weight stays TiedGradReducer's. (Functional collectives were tried first: inductor's
        comm passes kept at most one all-reduce in flight, the compute stream waiting on each.)
op_mat: the same for matrices only; vectors (biases, norms) in one coalesced group at the end.
(Both: the position embedding with the vectors; autograd copies its gradient instead of taking
it over, so an in-flight all-reduce would miss the copy.)
"""
import gc, json, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.utils.parametrize as P
from torch.distributed.distributed_c10d import _coalescing_manager
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core import train as T

VAR = {"v": "base"}
WORKS = []
REST = []  # parameters all-reduced after the backward pass
OP = [None]  # AVG on NCCL; gloo (the CPU check) has no AVG: SUM, then scaled


@torch.library.custom_op("oelm_scratch::all_reduce_start", mutates_args=("grad",))
def all_reduce_start(grad: torch.Tensor) -> None:
    """Start an in-place all-reduce of ``grad`` on NCCL's stream (ordered after the kernels
    launched so far) and return at once; the step waits after the backward pass. The process
    group is handed an alias of the same memory with no link back to ``grad`` (a view would
    keep ``grad`` referenced through its base): the references the process group keeps until
    the wait are then not references to ``grad``, so autograd takes ``grad`` over as .grad
    instead of copying it before the all-reduce has written it."""
    alias = grad.new_empty(0).set_(grad.untyped_storage(), grad.storage_offset(), grad.shape, grad.stride())
    WORKS.append(dist.all_reduce(alias, op=OP[0], async_op=True))


@all_reduce_start.register_fake
def _(grad):
    return None


class _ReduceGrad(torch.autograd.Function):
    """Identity; its backward starts the gradient's all-reduce right where it is computed."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        torch.ops.oelm_scratch.all_reduce_start(g)
        return g


class ReduceGrad(nn.Module):
    def forward(self, w):
        return _ReduceGrad.apply(w)


def parametrize(model, matrices_only):
    """Wrap the body's parameters (all but the tied weight and the position embedding, whose
    gradients autograd copies instead of taking them over) in the reducing identity; returns
    the rest, which the step all-reduces after the backward pass."""
    tied, rest = model.wte.weight, []
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p is tied or not p.requires_grad:
                continue
            if isinstance(module, nn.Embedding) or (matrices_only and p.dim() < 2):
                rest.append(p)
                continue
            P.register_parametrization(module, name, ReduceGrad(), unsafe=True)
    return rest


orig_wrap, orig_fb = T.TrainStep.wrap, T.TrainStep._forward_backward


def wrap(self):
    if not VAR["v"].startswith("op"):
        return orig_wrap(self)
    module = torch.compile(self.model) if self.compile else self.model
    if getattr(self, "tied", None) is not None:
        self.tied.remove()
    self.tied = T.TiedGradReducer.for_model(self.model)
    with torch.no_grad():
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t, 0)
    self.module = module
    self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
    self.vectors = list(REST)
    self.hooks = []
    self._compile_verified = not self.compile
    self._graph = None
    self._graph_warm = 0


def fb(self, batches):
    if not VAR["v"].startswith("op"):
        return orig_fb(self, batches)
    total = torch.zeros((), device=batches[0][0].device)
    self.tied.begin([x for x, _ in batches])
    for x, y in batches:
        self.tied.sync = True
        with self.autocast:
            loss = self.module(x, y)
        loss.backward()
        total += loss.detach().float()
    if self.vectors and dist.get_backend() == "nccl":
        with _coalescing_manager(device=x.device, async_ops=True) as cm:
            for p in self.vectors:
                dist.all_reduce(p.grad, op=OP[0])
        cm.wait()
    for p in self.vectors if dist.get_backend() != "nccl" else ():
        dist.all_reduce(p.grad, op=OP[0])
    for w in WORKS:
        w.wait()
    WORKS.clear()
    if OP[0] == dist.ReduceOp.SUM:
        for p in self.params:
            if p.grad is not None and p is not self.tied.weight:
                p.grad.mul_(1.0 / dist.get_world_size())
    self.tied.finish()
    return total / len(batches)


T.TrainStep.wrap, T.TrainStep._forward_backward = wrap, fb


def main():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    OP[0] = dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    preset = os.environ.get("PRESET", "medium512")
    warm = int(os.environ.get("WARM", "25"))
    rounds = int(os.environ.get("ROUNDS", "1"))
    for batch in [int(b) for b in os.environ.get("BATCH", "8").split(",")]:
      for rnd in range(rounds):
       for v in sys.argv[1:]:
        VAR["v"] = v
        torch.manual_seed(0)
        cfg = model_config(preset, "gpt_base")
        model = GPT(cfg).to(device)
        if v.startswith("op"):
            REST[:] = parametrize(model, matrices_only=v.startswith("op_mat"))
        tc = TrainConfig(compile=True)
        try:
            step = T.make_step(model, T.configure_optimizer(model, tc, device), tc, device,
                               ddp=not v.startswith("plain"))
            gen = torch.Generator().manual_seed(rank + 1)
            data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen) for _ in range(4)]
            xs = [d[:, :-1].contiguous().to(device) for d in data]
            ys = [d[:, 1:].contiguous().to(device) for d in data]
            n = [0]
            def one(i):
                n[0] += 1
                return step([(xs[i % 4], ys[i % 4])], 1e-4, n[0])
            t0 = time.perf_counter()
            for i in range(warm):
                loss, norm = one(i)
            if not cuda:
                print(json.dumps({"variant": v, "rank": rank, "loss": float(loss), "norm": float(norm),
                                  "wsum": sum(p.detach().double().sum().item() for p in step.params)}), flush=True)
                continue
            torch.cuda.synchronize()
            setup = time.perf_counter() - t0
            wsum = sum(p.detach().double().sum().item() for p in step.params)
            secs = []
            for _ in range(7):
                dist.barrier(); torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for i in range(10):
                    one(i)
                b.record(); b.synchronize()
                t = torch.tensor(a.elapsed_time(b) / 10, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                secs.append(float(t))
            secs.sort()
            if rank == 0:
                print(json.dumps({"variant": v, "round": rnd, "world": world, "batch": batch,
                                  "ms": round(secs[3], 3), "min": round(secs[0], 3), "max": round(secs[-1], 3),
                                  "graph": step._graph is not None, "loss25": round(float(loss), 6),
                                  "norm25": round(float(norm), 5), "wsum25": wsum,
                                  "setup_s": round(setup, 1)}), flush=True)
        except Exception as exc:
            import traceback
            if rank == 0:
                print(json.dumps({"variant": v, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
                traceback.print_exc()
            os._exit(1)
        del step, one
        gc.collect()
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    os._exit(0)


main()
