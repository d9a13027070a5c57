"""Scratch (2026-11-26, eleventh stop): two GPUs exchange the body's gradients through the copy
engines (NVLink peer copies into a symmetric-memory receive buffer, no SMs, no NCCL), each copy
started inside the compiled backward right after the kernel that wrote the gradient; after the
backward a barrier, then each rank adds the peer's copy (bitwise the same sum on both ranks) and
halves it. The tied weight stays TiedGradReducer's (NCCL). Against the trainer's DDP step.
    torchrun --nproc_per_node 2 ce_reduce.py base ce ce_mat
ce:     every body parameter's gradient sent from inside the backward;
ce_mat: matrices from inside the backward, the rest (norms, biases, positions) after it.
ce2:    as ce, and the tied weight's two shares by the copy engines too (CETied), the halving
        folded into AdamW's divisor (the gradients hold the sum).
``ce_overlap.py`` measured why: 180 MB each way by the copy engines beside the one-GPU step cost
it ~0.1 ms, where NCCL's all-reduce costs the two-GPU step ~0.6.
"""
import gc, json, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.utils.parametrize as P
import torch.distributed._symmetric_memory as symm_mem
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core import train as T

VAR = {"v": "base"}
SEND, HDL, PEER_SLOTS, RECV_SLOTS, KEEP = [None], [None], [], [], []
STATE = {}


@torch.library.custom_op("oelm_scratch::ce_send", mutates_args=("grad",))
def ce_send(grad: torch.Tensor, slot: int) -> None:
    """Copy ``grad`` into the peer's receive slot on the send stream (a device-to-device memcpy
    into peer memory: the copy engines). Keeps an alias of its memory until the step's join
    (not ``grad`` itself: autograd would then copy it instead of taking it over)."""
    alias = grad.new_empty(0).set_(grad.untyped_storage(), grad.storage_offset(), (grad.numel(),), (1,))
    SEND[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SEND[0]):
        PEER_SLOTS[slot].copy_(alias)
    KEEP.append(alias)


@ce_send.register_fake
def _(grad, slot):
    return None


class _SendGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, slot):
        ctx.slot = slot
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        torch.ops.oelm_scratch.ce_send(g, ctx.slot)
        return g, None


class SendGrad(nn.Module):
    def __init__(self, slot):
        super().__init__()
        self.slot = slot

    def forward(self, w):
        return _SendGrad.apply(w, self.slot)


def setup(model, matrices_only, device):
    """Receive buffer, peer slots and the parametrizations. Returns (body params, params sent
    after the backward)."""
    tied = model.wte.weight
    body = [p for p in model.parameters() if p is not tied and p.requires_grad]
    n = sum(p.numel() for p in body)
    group = dist.group.WORLD
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    recv = symm_mem.empty(n, dtype=torch.float32, device=device)
    HDL[0] = symm_mem.rendezvous(recv, group.group_name)
    peer = HDL[0].get_buffer(1 - dist.get_rank(), (n,), torch.float32)
    PEER_SLOTS.clear(); RECV_SLOTS.clear()
    offset = 0
    for p in body:
        PEER_SLOTS.append(peer[offset:offset + p.numel()])
        RECV_SLOTS.append(recv[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    SEND[0] = torch.cuda.Stream(device)
    slot_of = {id(p): i for i, p in enumerate(body)}
    late = []
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in slot_of:
                continue
            if matrices_only and (p.dim() < 2 or isinstance(module, nn.Embedding)):
                late.append(p)
                continue
            P.register_parametrization(module, name, SendGrad(slot_of[id(p)]), unsafe=True)
    return body, late, slot_of


def _exchange_buffer(numel, dtype, device):
    """(this rank's receive buffer, the peer's as a tensor on this device)."""
    mine = symm_mem.empty(numel, dtype=dtype, device=device)
    hdl = symm_mem.rendezvous(mine, dist.group.WORLD.group_name)
    return mine, hdl.get_buffer(1 - dist.get_rank(), (numel,), dtype)


def _send(dst, src):
    """dst.copy_(src) on the send stream, after what the current stream has queued so far."""
    SEND[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(SEND[0]):
        dst.copy_(src)


class CETied:
    """ce2: TiedGradReducer's two shares sent by the copy engines instead of NCCL: the output
    share (dense) when the backward starts, the embedding share's rows (and the ids, with the
    forward) when the embedding's backward has written them. ``finish`` (after the barrier)
    leaves the *sum* over the two ranks in .grad, the rows added in rank order on both."""

    def __init__(self, model, weight, tokens, device):
        self.weight, self.sync = weight, True
        v, d = weight.shape
        self.recv_out, self.peer_out = _exchange_buffer(v * d, torch.float32, device)
        self.recv_rows, self.peer_rows = _exchange_buffer(tokens * d, torch.float32, device)
        self.recv_ids, self.peer_ids = _exchange_buffer(tokens, torch.int64, device)
        model.split_tied_gradient(self._on_output_grad)
        self._hook = weight.register_post_accumulate_grad_hook(self._on_embedding_grad)

    def remove(self):
        self._hook.remove()

    def begin(self, tokens):
        self.ids = torch.cat([t.flatten() for t in tokens]).sort().values
        self.first = torch.ones_like(self.ids, dtype=torch.bool)
        self.first[1:] = self.ids[1:] != self.ids[:-1]
        _send(self.peer_ids, self.ids)

    def _on_output_grad(self, grad):
        self.out = grad
        _send(self.peer_out, grad.view(-1))

    def _on_embedding_grad(self, weight):
        self.rows = weight.grad[self.ids] * self.first.unsqueeze(1)
        _send(self.peer_rows, self.rows.view(-1))

    def finish(self):
        out = self.out.add_(self.recv_out.view_as(self.out))
        mine = dist.get_rank()
        ids = {mine: self.ids, 1 - mine: self.recv_ids}
        rows = {mine: self.rows, 1 - mine: self.recv_rows.view_as(self.rows)}
        for r in (0, 1):
            out.index_add_(0, ids[r], rows[r])
        self.weight.grad = out
        self.out = self.rows = None


orig_wrap, orig_fb, orig_clip = T.TrainStep.wrap, T.TrainStep._forward_backward, T.TrainStep._clip_and_step


def clip(self):
    """ce2: the gradients hold the sum over the two ranks; the halving rides in AdamW's divisor."""
    if VAR["v"] != "ce2":
        return orig_clip(self)
    grads = [p.grad for p in self.params if p.grad is not None]
    norm = 0.5 * torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    self.optimizer.grad_scale = 2.0 * torch.clamp((norm + 1e-6) / (self.grad_clip or float("inf")), min=1.0)
    try:
        self.optimizer.step()
    finally:
        del self.optimizer.grad_scale
    return norm


def wrap(self):
    if not VAR["v"].startswith("ce"):
        return orig_wrap(self)
    module = torch.compile(self.model) if self.compile else self.model
    if getattr(self, "tied", None) is not None:
        self.tied.remove()
    if VAR["v"] == "ce2":
        self.tied = CETied(self.model, self.model.split_tied_gradient(None), STATE["tokens"],
                           next(self.model.parameters()).device)
    else:
        self.tied = T.TiedGradReducer.for_model(self.model)
    with torch.no_grad():
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t, 0)
    self.module = module
    self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
    self.hooks = []
    self._compile_verified = not self.compile
    self._graph = None
    self._graph_warm = 0


def fb(self, batches):
    if not VAR["v"].startswith("ce"):
        return orig_fb(self, batches)
    body, late, slot_of = STATE["body"], STATE["late"], STATE["slot_of"]
    total = torch.zeros((), device=batches[0][0].device)
    self.tied.begin([x for x, _ in batches])
    for x, y in batches:
        self.tied.sync = True
        with self.autocast:
            loss = self.module(x, y)
        loss.backward()
        total += loss.detach().float()
    cur = torch.cuda.current_stream()
    if late:
        SEND[0].wait_stream(cur)
        with torch.cuda.stream(SEND[0]):
            for p in late:
                PEER_SLOTS[slot_of[id(p)]].copy_(p.grad.view(-1))
    cur.wait_stream(SEND[0])
    KEEP.clear()
    HDL[0].barrier(channel=0)           # the peer's copies into this rank's buffer are done
    grads = [p.grad for p in body]
    torch._foreach_add_(grads, RECV_SLOTS)  # own + peer: the same sum, bit for bit, on both ranks
    if VAR["v"] != "ce2":
        torch._foreach_mul_(grads, 0.5)
    self.tied.finish()
    HDL[0].barrier(channel=1)           # read before the peer's next step writes it again
    return total / len(batches)


T.TrainStep.wrap, T.TrainStep._forward_backward, T.TrainStep._clip_and_step = wrap, fb, clip


def main():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
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
        if v.startswith("ce"):
            body, late, slot_of = setup(model, v == "ce_mat", device)
            STATE.update(body=body, late=late, slot_of=slot_of, tokens=batch * cfg.block_size)
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
            torch.cuda.synchronize()
            setup_s = time.perf_counter() - t0
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
                                  "setup_s": round(setup_s, 1)}), flush=True)
        except Exception as exc:
            import traceback
            if rank == 0:
                print(json.dumps({"variant": v, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
                traceback.print_exc()
            os._exit(1)
        del step, one
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    os._exit(0)


main()
