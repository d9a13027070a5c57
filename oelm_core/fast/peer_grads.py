"""Data parallelism on the GPUs of one host without NCCL in the step: each gradient is copied into
every other GPU's memory by the copy engines (NVLink), from inside the compiled backward pass, as
soon as the kernel that wrote it has run.

Why not DDP: the bytes are not the problem (the copy engines move a step's gradients in a small
part of a step, beside the compute); DDP's work on the compute stream is: the copies of every
gradient into its buckets, the NCCL kernels' SMs, and the buckets still in flight when the
backward ends. Here the copy engines move the gradients while the SMs compute, and what is left
after the backward is one barrier and the adds of the body's gradients and the embedding's rows.
Its gain over DDP, at 16 and 64 x 512 tokens per GPU: benchmarks/README.md.

Two pieces:

- ``ParameterTap``: every access of a tapped parameter inside the model returns an identity view
  whose backward hands the gradient to a callback, through a custom op, so that under
  ``torch.compile`` the call sits in the compiled backward graph right after the gradient's kernel
  (a tensor hook would run only when the whole compiled backward has returned). The parameters,
  their names and the state_dict stay as they are.
- ``PeerGradExchange``: the sends into the peers' symmetric-memory receive buffers, the tied
  embedding/output weight's two shares (the dense output share as the backward starts, then only
  the rows of the batch's tokens), and ``finish``:
  after a barrier each rank adds the others' copies to its own, in rank order ((g0 + g1) + g2 ...
  on every rank: float addition is commutative, not associative), so the sums (and the weights)
  stay bitwise equal. The output shares (103 MB a rank) are summed during the backward, on a side
  stream, once every peer signals that its copy has landed, and the token ids are sorted there
  beside the forward, off the step's path.

``finish`` leaves the *sum* over the ranks in ``.grad`` (``grad_divisor`` = the world size): the
step averages it (``oelm_core.step.TrainStep.clip_and_step``). Works inside the
trainer's whole-step CUDA graph (``oelm_core.fast.graph_step``: copies, barriers and all).
On N GPUs each rank sends N - 1 copies of its gradients (a ring all-reduce would send 2 (N - 1) / N
of them, in 2 (N - 1) dependent rounds): the copy engines carry them beside the compute, and the
sum after the barrier reads N buffers.

Switch: ``train.grad_exchange`` (auto: this exchange on two GPUs, where it was measured to pay,
else DDP; ddp; peer: this exchange on any number of GPUs of one host).
It needs the split of the tied weight's gradient that the fused loss offers (``train.fused_loss``).
Gain: benchmarks/README.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from oelm_core.fast.loss import split_tied_gradient

log = logging.getLogger(__name__)


def first_of_each(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N,) -> (sorted ids, bool mask of each id's first place): the tied weight's embedding
    rows are sent once each, the repeats as exact zeros (gathered from a padding row, so the ids
    must be words, < ``cfg.vocab_size``, as the data's tokens are)."""
    ids = ids.sort().values
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids, first


# The live taps, by id: the custom op carries the id (an int) so that the compiled graph holds
# no Python object.
_TAPS: "weakref.WeakValueDictionary[int, ParameterTap]" = weakref.WeakValueDictionary()
_TAP_IDS = itertools.count()


@torch.library.custom_op("oelm::tap_grad", mutates_args=("grad",))
def _tap_grad(grad: torch.Tensor, tap: int, slot: int) -> None:
    # Declared as mutating ``grad`` so that the compiler neither drops the call (it returns
    # nothing) nor moves it after a later write of the gradient.
    _TAPS[tap].on_grad(slot, grad)


@_tap_grad.register_fake
def _(grad, tap, slot):
    return None


class _Tap(torch.autograd.Function):
    """Identity in the forward; hands the incoming gradient to tap ``tap`` in the backward."""

    @staticmethod
    def forward(ctx, weight, tap, slot):
        ctx.tap, ctx.slot = tap, slot
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.ops.oelm.tap_grad(grad, ctx.tap, ctx.slot)
        return grad, None, None


def _tapped(name: str, tap: int, slot: int) -> property:
    """The attribute ``name`` of a tapped module: its parameter seen through ``_Tap``."""
    return property(lambda module: _Tap.apply(module._parameters[name], tap, slot))


class ParameterTap:
    """Call ``on_grad(slot, grad)`` with the gradient of ``params[slot]`` during each backward.

    Each module holding one of ``params`` gets a subclass (same name) whose property of that
    attribute returns ``_Tap(param)``: what ``torch.nn.utils.parametrize`` does, without renaming
    the parameter in the state_dict. ``grad`` is the gradient of this backward alone (before it
    is added to ``.grad``); its memory is handed on to ``.grad`` afterwards, so a callback that
    keeps using it asynchronously must keep it alive without holding the tensor (autograd copies
    a gradient that is referenced elsewhere instead of taking it over). ``remove()`` restores the
    modules; keep the object until then (the modules hold only its id). A parameter must be read
    once per forward (a second read would send a part).
    """

    def __init__(self, model: nn.Module, params: list[nn.Parameter], on_grad: Callable[[int, torch.Tensor], None]):
        self.id, self.on_grad = next(_TAP_IDS), on_grad
        slot_of = {id(p): i for i, p in enumerate(params)}
        self._modules: list[tuple[nn.Module, type]] = []
        tapped = 0
        for module in model.modules():
            names = {name: slot_of[id(p)] for name, p in module.named_parameters(recurse=False) if id(p) in slot_of}
            if names:
                cls = type(module)
                props = {name: _tapped(name, self.id, slot) for name, slot in names.items()}
                module.__class__ = type(cls.__name__, (cls,), {**props, "__module__": cls.__module__})
                self._modules.append((module, cls))
                tapped += len(names)
        _TAPS[self.id] = self
        if tapped != len(params):
            self.remove()
            raise ValueError(f"{len(params) - tapped} of the parameters to tap are not in the model")

    def remove(self) -> None:
        for module, cls in self._modules:
            module.__class__ = cls
        self._modules = []
        _TAPS.pop(self.id, None)


class PeerGradExchange:
    """The data-parallel gradient of the ranks on CUDA GPUs of one host with peer access (see the
    module).

    Use: ``begin(tokens)`` before a step's first backward; ``sync = False`` on micro-steps that
    only accumulate (nothing is sent then; the last one sends the accumulated gradient);
    ``finish()`` after the last backward. Then every trainable parameter's ``.grad`` holds the
    sum over the ranks, bitwise the same on each.
    """

    gradients_by = "nvlink copies"

    @classmethod
    def for_model(cls, model: nn.Module, device: torch.device) -> Optional["PeerGradExchange"]:
        """An exchange for ``model`` on this rank, or None (logged) where it cannot run: not CUDA
        GPUs of one host with peer access under NCCL, or no symmetric memory in this torch.
        Collective: every rank calls it and all get an exchange or all None."""
        if cls.not_here(device) is not None:
            log.info(
                "gradients by DDP: the NVLink copy exchange needs CUDA GPUs of one host under NCCL (%s)",
                cls.not_here(device),
            )
            return None  # the same on every rank: no need to agree
        exchange = reason = None
        try:
            exchange = cls(model, device)
        except Exception as exc:  # no symmetric memory, no peer access, another host...
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        failed = torch.tensor(float(reason is not None), device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            if exchange is not None:
                exchange.remove()
            log.info("gradients by DDP: no NVLink copy exchange (%s)", reason or "not on another rank")
            return None
        return exchange

    @staticmethod
    def not_here(device: torch.device) -> Optional[str]:
        """Why this job cannot exchange by NVLink copies, as every rank knows it without asking
        the others ("here under gloo"), or None where it may try."""
        world, backend = dist.get_world_size(), dist.get_backend()
        # torchrun's processes on this host; two single-GPU nodes have one each: no peer memory
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if device.type != "cuda":
            return f"here on {device.type}"
        if world < 2:
            return f"here {world} rank"
        if backend != "nccl":
            return f"here under {backend}"
        if local != world:
            return "here the ranks are on different nodes"
        return None

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self._connect()
        self.grad_divisor = float(self.world)
        self.tied = split_tied_gradient(model, None)
        if self.tied is None and getattr(getattr(model, "cfg", None), "tie_embeddings", False):
            # Not split (the reference loss): the embedding and the output layer would each send a part.
            raise ValueError("the tied embedding/output weight is not split (train.fused_loss off)")
        if self.tied is not None and not self.tied.requires_grad:
            self.tied = None
        self.params = [p for p in model.parameters() if p.requires_grad and p is not self.tied]
        if any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
            raise TypeError("the exchange sends float32 gradients; the model has other parameters")
        sizes = [p.numel() for p in self.params]
        recv, peers = self._buffer(sum(sizes), torch.float32)
        # Per parameter, its place in each peer's buffer; per rank, that rank's gradients as received.
        self._peer_slots = list(zip(*(peer.split(sizes) for peer in peers)))
        self._recv_slots = [
            None if row is None else [s.view_as(p) for s, p in zip(row.split(sizes), self.params)] for row in recv
        ]
        self._keep: list[torch.Tensor] = []  # memory of gradients in flight, until finish()
        self.sync = True
        self._out = self._ids = None
        if self.tied is not None:
            v, d = self.tied.shape
            self._recv_out, self._peer_out = self._buffer(v * d, torch.float32)
            self._rows_capacity = 0
            # A padding row of the output layer (medium512: 50,304 rows for 50,257 words) is no
            # token's: its embedding gradient is 0, and a repeated id can gather it instead of its
            # own row times a mask of 0s afterwards (one kernel fewer).
            vocab = getattr(getattr(model, "cfg", None), "vocab_size", v)
            self._zero_row = v - 1 if v > vocab else None
        self._tap = ParameterTap(model, self.params, self._on_grad)
        if self.tied is not None:
            split_tied_gradient(model, self._on_output_grad)
            self._loss = model.output_loss  # not the model: its loss's hook refers to this exchange
            self._hook = self.tied.register_post_accumulate_grad_hook(self._on_embedding_grad)

    def remove(self) -> None:
        """Restore the model's modules and hooks (before another exchange, DDP or none takes over)."""
        self._tap.remove()
        if self.tied is not None:
            self._hook.remove()
            self._loss.grad_hook = None

    # The link to the peers: symmetric memory, a copy stream and a side stream. Small methods, so
    # that the arithmetic above them can be tested on the CPU with several exchanges in one process
    # (tests/test_peer_grads.py).
    def _connect(self) -> None:
        """This rank and the world, symmetric memory for the process group, the copy and side streams."""
        # Peer pointers and barriers are all the exchange uses: no NVLink multicast objects
        # (NVSwitch resources, which a crashed program can leave held on a shared host).
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._group = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):  # older torch needs it
            enable(self._group)
        self._stream = torch.cuda.Stream(self.device)
        self._side = torch.cuda.Stream(self.device)
        self._side_forked = False

    @property
    def _others(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]

    def _buffer(self, numel: int, dtype: torch.dtype) -> tuple[list, list[torch.Tensor]]:
        """(per rank, the (numel,) row of this rank's receive buffer that rank writes, None for
        this rank; this rank's row in each other rank's buffer, as tensors this GPU can write, in
        ``_others``' order). A buffer has a row per other rank: rank s writes row s - (s > r) of
        rank r's. Collective."""
        import torch.distributed._symmetric_memory as symm_mem

        def row(sender: int, receiver: int) -> int:
            return sender - (sender > receiver)

        mine = symm_mem.empty((self.world - 1) * numel, dtype=dtype, device=self.device)
        self._handle = symm_mem.rendezvous(mine, self._group)
        rows = mine.view(self.world - 1, numel)
        received = [None if s == self.rank else rows[row(s, self.rank)] for s in range(self.world)]
        peers = [self._handle.get_buffer(r, rows.shape, dtype)[row(self.rank, r)] for r in self._others]
        return received, peers

    def _send(self, dsts: Sequence[torch.Tensor], src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for each dst (the peers' memory) on the copy stream, after what the
        current stream has queued so far; ``src``'s memory is kept until ``finish`` joins the stream."""
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dst in dsts:
                dst.copy_(src.reshape(-1))
        # An alias of the storage, not src: were src referenced, autograd would copy a gradient
        # into .grad instead of taking it over.
        self._keep.append(src.new_empty(0).set_(src.untyped_storage()))

    @contextmanager
    def _aside(self):
        """Run the block on the side stream, after what the current stream has queued so far;
        the current stream waits for it at ``_rejoin`` or ``_join``. (Every block waits for the
        current stream first, so memory freed there is never reused here too early.)"""
        self._side.wait_stream(torch.cuda.current_stream())
        self._side_forked = True
        with torch.cuda.stream(self._side):
            yield

    def _rejoin(self) -> None:
        """The current stream waits for the side stream's work so far."""
        if self._side_forked:  # a CUDA graph's capture may only wait on a stream it has forked
            torch.cuda.current_stream().wait_stream(self._side)

    def _join(self) -> None:
        """The current stream waits for every copy this rank has started and for the side
        stream; the copies' sources are free."""
        torch.cuda.current_stream().wait_stream(self._stream)
        self._rejoin()
        self._side_forked = False
        self._keep.clear()

    def _barrier(self, channel: int) -> None:
        """Every rank's current stream meets here (each after its own earlier work)."""
        self._handle.barrier(channel=channel)

    def _after_peer(self, channel: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the side stream once this rank's copies so far have left and every
        peer's so far have landed here: each rank raises flag ``channel`` on each peer behind its
        copies (the copy stream's order), and the side stream waits for every peer's. Channels 0
        and 1 are the barriers'."""
        with torch.cuda.stream(self._stream):
            for r in self._others:
                self._handle.put_signal(r, channel=channel)
        with self._aside():
            self._side.wait_stream(self._stream)
            for r in self._others:
                self._handle.wait_signal(r, channel=channel)
            fn()

    def _sum_in_rank_order(self, own: list[torch.Tensor], received: list) -> None:
        """own := the sum over the ranks, (x0 + x1) + x2 + ... on every rank, so that all hold the
        same bits. ``received[r]``: rank r's tensors as they arrived here (None for this rank).
        x0 + x1 is the same sum in either order: ranks 0 and 1 add to their own in place (on two
        GPUs that is all); a rank past 1 sums apart from rank 0's and copies the sum in."""
        if self.rank < 2:
            torch._foreach_add_(own, received[1 - self.rank])
            for r in range(2, self.world):
                torch._foreach_add_(own, received[r])
            return
        total = torch._foreach_add(received[0], received[1])
        for r in range(2, self.world):
            torch._foreach_add_(total, own if r == self.rank else received[r])
        torch._foreach_copy_(own, total)

    def _on_grad(self, slot: int, grad: torch.Tensor) -> None:
        if not self.sync:
            return
        self._sent[slot] += 1
        earlier = self.params[slot].grad  # earlier micro-steps' share (grad_accum > 1)
        self._send(self._peer_slots[slot], grad if earlier is None else grad + earlier)

    def begin(self, tokens: list[torch.Tensor]) -> None:
        """Before a step's first backward. ``tokens``: this rank's input ids, one (B, T) tensor
        per micro-step (as many on every rank). The embedding share goes as rows while the ranks'
        tokens together are fewer than the weight's rows (medium512 on two GPUs: up to 25k tokens
        per GPU), else densely at the end."""
        self._sent = [0] * len(self.params)
        if self.tied is None:
            return
        n = sum(t.numel() for t in tokens)
        self._ids = None
        if self.world * n > self.tied.size(0):
            return
        if n > self._rows_capacity:  # the first step of a shape: every rank in step
            d = self.tied.size(1)
            self._recv_rows, self._peer_rows = self._buffer(n * d, torch.float32)
            self._recv_ids, self._peer_ids = self._buffer(n, torch.int64)
            self._rows_capacity = n
        # The sorted ids are needed only at the embedding's backward, the end of the step: they
        # are made beside the forward, not before it.
        with self._aside():
            self._ids, first = first_of_each(torch.cat([t.flatten() for t in tokens]))
            self._send([peer[:n] for peer in self._peer_ids], self._ids)
            if self._zero_row is None:
                self._pick, self._mask = self._ids, first.unsqueeze(1)
            else:
                self._pick, self._mask = torch.where(first, self._ids, self._zero_row), None

    def _sum_output_shares(self) -> None:
        self._sum_in_rank_order(
            [self._out], [None if row is None else [row.view_as(self._out)] for row in self._recv_out]
        )

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._out = grad if self._out is None else self._out.add_(grad)
        if self.sync and self._ids is not None:
            self._send(self._peer_out, self._out)
            # The output shares' sum (103 MB a rank at medium512) is taken while the backward
            # runs rather than after it.
            self._after_peer(2, self._sum_output_shares)

    def _on_embedding_grad(self, weight: torch.Tensor) -> None:
        if self.sync and self._ids is not None:
            self._rejoin()  # the sorted ids
            self._rows = weight.grad[self._pick]  # (n, d): each id's row once, repeats 0
            if self._mask is not None:
                self._rows.mul_(self._mask)
            self._send([peer[: self._rows.numel()] for peer in self._peer_rows], self._rows)

    def finish(self) -> None:
        """After the last micro-step's backward: every ``.grad`` := the sum over the ranks."""
        if self._sent != [1] * len(self.params):  # runs while eager and while captured, not replayed
            twice = [i for i, n in enumerate(self._sent) if n != 1]
            raise RuntimeError(
                f"{len(twice)} parameters' gradients were not sent exactly once in "
                f"this step (a parameter read twice in the forward, or unused); "
                f"set train.grad_exchange: ddp"
            )
        if self.tied is not None and self._ids is None:  # the dense way: both shares in one
            self._out.add_(self.tied.grad)
            self._send(self._peer_out, self._out)
        self._join()
        self._barrier(0)  # the peers' copies into this rank's buffers are complete
        self._sum_in_rank_order([p.grad for p in self.params], self._recv_slots)
        if self.tied is not None:
            out = self._out
            if self._ids is None:
                self._sum_output_shares()
            else:  # the output shares were summed during the backward (_on_output_grad)
                n, size = self._ids.numel(), self._rows.numel()
                for r in range(self.world):  # the same order on every rank
                    ids = self._ids if r == self.rank else self._recv_ids[r][:n]
                    rows = self._rows if r == self.rank else self._recv_rows[r][:size].view_as(self._rows)
                    out.index_add_(0, ids, rows)
            self.tied.grad = out  # the output share's buffer becomes the gradient: no copy
        self._barrier(1)  # read before a peer's next step writes it again
        self._out = self._ids = self._pick = self._mask = self._rows = None
