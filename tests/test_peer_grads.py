"""oelm_core.fast.peer_grads on the CPU: the parameter tap that starts each gradient's copy from
inside the (compiled) backward; the exchange's arithmetic with two exchanges in one process (what
the GPUs add, streams and symmetric memory, left out). The step's handling of gradients that hold
a sum over ranks: tests/test_step.py; the copies between two GPUs themselves:
tests/test_distributed.py's two-GPU test."""

import copy
import threading
from contextlib import nullcontext

import pytest
import torch

from oelm_core import VARIANTS, build_model, fast
from oelm_core.config import ConfigError, RunConfig, TrainConfig
from oelm_core.fast.peer_grads import ParameterTap, PeerGradExchange


def fused(model):
    """``model`` with the fused loss, which splits the tied weight's gradient (train.fused_loss),
    as the trainer builds it."""
    return fast.apply(model, TrainConfig())


def body(model):
    """The parameters the exchange taps: every trainable one except the tied embedding/output."""
    return [p for p in model.parameters() if p.requires_grad and p is not model.wte.weight]


def batch(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    return [torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g) for _ in range(2)]


class Recorder:
    """Each gradient the tap hands over, and how many had reached .grad by then."""

    def __init__(self, params):
        self.params, self.sent = params, {}
        self.accumulated_at_first_send = None

    def __call__(self, slot, grad):
        if self.accumulated_at_first_send is None:
            self.accumulated_at_first_send = sum(p.grad is not None for p in self.params)
        assert slot not in self.sent, f"slot {slot} sent twice"
        self.sent[slot] = grad.clone()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tap_hands_over_each_gradient_once_and_leaves_the_model_as_it_was(variant):
    model = fused(build_model("tiny", variant, seed=0))
    x, y = batch(model)
    keys, classes = list(model.state_dict()), [type(m) for m in model.modules()]
    reference = model(x, y)
    reference.backward()
    expected = [p.grad.clone() for p in body(model)]
    model.zero_grad(set_to_none=True)

    params = body(model)
    recorder = Recorder(params)
    tap = ParameterTap(model, params, recorder)
    loss = model(x, y)
    loss.backward()
    assert torch.equal(loss, reference)
    assert sorted(recorder.sent) == list(range(len(params)))
    for slot, p in enumerate(params):
        assert torch.equal(recorder.sent[slot], p.grad)
        assert torch.equal(p.grad, expected[slot])  # the same ops: the model cannot tell
    assert list(model.state_dict()) == keys and list(model.parameters())[1] is params[0]
    tap.remove()
    assert [type(m) for m in model.modules()] == classes


def test_under_compile_every_gradient_is_sent_before_any_reaches_grad():
    """The sends sit in the compiled backward graph, each right after its gradient's kernel: all
    of them have run when the compiled backward returns and autograd starts filling .grad."""
    model = fused(build_model("tiny", "oelm_freeze", seed=0))
    x, y = batch(model)
    params = body(model)
    model(x, y).backward()
    expected = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)

    recorder = Recorder(params)
    tap = ParameterTap(model, params, recorder)
    compiled = torch.compile(model)
    for _ in range(2):  # the second call runs the cached graphs
        recorder.sent, recorder.accumulated_at_first_send = {}, None
        compiled(x, y).backward()
        assert recorder.accumulated_at_first_send == 0
        assert len(recorder.sent) == len(params)
        for slot, p in enumerate(params):
            assert torch.equal(recorder.sent[slot], p.grad)
            torch.testing.assert_close(p.grad, expected[slot], rtol=1e-4, atol=1e-6)
        model.zero_grad(set_to_none=True)
    tap.remove()


def test_tap_refuses_a_parameter_the_model_does_not_hold():
    model = fused(build_model("tiny", "gpt_base", seed=0))
    stranger = torch.nn.Parameter(torch.zeros(3))
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="1 of the parameters to tap are not in the model"):
        ParameterTap(model, body(model) + [stranger], lambda slot, grad: None)
    assert [type(m) for m in model.modules()] == classes


class InProcessGroup:
    """PeerGradExchanges (or ``cls``, a subclass) of ``len(models)`` ranks in one process: each
    one's "peer memory" is the others' receive buffers, a copy is immediate, and the barrier is a
    threading.Barrier (the finish() calls run in a thread each). What the GPUs add (streams, copy
    engines, symmetric memory) is left out; the arithmetic is the library's."""

    def __init__(self, models, cls=PeerGradExchange):
        self.models, self.buffers, self.meet = models, {}, threading.Barrier(len(models))
        self.exchanges = [self._exchange(model, rank, cls) for rank, model in enumerate(models)]

    def _exchange(self, model, rank, cls):
        group, world = self, len(self.models)

        class InProcess(cls):
            def _connect(self):
                self.rank, self.world, self._allocated, self._pending = rank, world, 0, []

            def _buffer(self, numel, dtype):
                i, self._allocated = self._allocated, self._allocated + 1
                mem = [
                    group.buffers.setdefault((r, i), torch.full((world - 1, numel), -1).to(dtype)) for r in range(world)
                ]
                received = [None if s == self.rank else mem[self.rank][s - (s > self.rank)] for s in range(world)]
                return received, [mem[r][self.rank - (self.rank > r)] for r in self._others]

            def _send(self, dsts, src):
                for dst in dsts:
                    dst.copy_(src.reshape(-1))

            def _join(self):
                # Every rank's backward pass has run (one after another): the peers' copies have
                # landed, as the GPU's side stream waits for them to.
                for fn in self._pending:
                    fn()
                self._pending.clear()

            def _after_peer(self, channel, fn):
                self._pending.append(fn)

            def _aside(self):
                return nullcontext()

            def _rejoin(self):
                pass

            def _barrier(self, channel):
                # The ranks' backward passes run one after another in the main thread: only
                # their finish() calls, in a thread each, can meet.
                if threading.current_thread() is not threading.main_thread():
                    group.meet.wait(timeout=60)

        return InProcess(model, torch.device("cpu"))

    def backward(self, rank, micro):
        """Rank ``rank``'s micro-batches [(x, y), ...], as TrainStep runs them."""
        exchange, model = self.exchanges[rank], self.models[rank]
        exchange.begin([x for x, _ in micro])
        for i, (x, y) in enumerate(micro):
            exchange.sync = i == len(micro) - 1
            (model(x, y) / len(micro)).backward()

    def finish(self):
        """Every rank's finish(), side by side; the first rank's error, if any, is raised."""
        errors = [None] * len(self.models)

        def run(rank):
            try:
                self.exchanges[rank].finish()
            except Exception as exc:  # a failed rank must not leave the others at the barrier
                errors[rank] = exc
                self.meet.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raised = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if raised:
            raise raised[0]

    def remove(self):
        for exchange in self.exchanges:
            exchange.remove()


def micro_batches(model, rank, n_micro, batch):
    g = torch.Generator().manual_seed(100 + rank)
    ids = [
        torch.randint(0, model.cfg.vocab_size, (batch, model.cfg.block_size + 1), generator=g) for _ in range(n_micro)
    ]
    return [(t[:, :-1], t[:, 1:]) for t in ids]


@pytest.mark.parametrize(
    "variant, n_micro, batch, rows, vocab, world",
    [
        ("oelm_freeze", 1, 2, True, 128, 2),  # 2 ranks x 64 tokens <= 128 rows: the tied weight as rows
        ("oelm_freeze", 1, 2, True, 100, 2),  # the repeats' rows gathered from a padding row (100 -> 128)
        ("gpt_base", 1, 4, False, 128, 2),  # 2 x 128 > 128: the tied weight's shares in one, densely
        ("oelm_nofreeze", 2, 1, True, 128, 2),  # two micro-steps: the last sends the accumulated gradient
        ("oelm_nofreeze", 2, 1, True, 100, 2),
        ("oelm_poet", 2, 2, False, 128, 2),
        # more ranks: rank 2 and up keep their own while the sum starts from rank 0's
        ("oelm_freeze", 1, 1, True, 100, 3),  # 3 x 32 tokens <= 128 rows
        ("gpt_base", 1, 2, False, 128, 3),  # 3 x 64 > 128: densely
        ("oelm_nofreeze", 1, 1, True, 128, 4),  # 4 x 32 = 128 rows
        ("oelm_poet", 2, 1, False, 128, 4),
    ],
)
def test_exchange_leaves_the_sum_of_every_ranks_gradients_bitwise_equal_on_each(
    variant, n_micro, batch, rows, vocab, world
):
    """The exchange's arithmetic (tapped sends, the tied weight's shares, finish) against the
    gradients of the ranks' batches computed apart: .grad = their sum, the same bits on every rank
    (float addition is not associative: a rank that summed in its own order would drift)."""
    base = fused(build_model("tiny", variant, seed=0, vocab_size=vocab))
    assert base.cfg.padded_vocab_size == 128
    batches = [micro_batches(base, r, n_micro, batch) for r in range(world)]
    expected = []
    for micro in batches:  # each rank's own gradient, without an exchange
        alone = copy.deepcopy(base)
        for x, y in micro:
            (alone(x, y) / n_micro).backward()
        expected.append([p.grad for p in alone.parameters() if p.requires_grad])

    group = InProcessGroup([copy.deepcopy(base) for _ in range(world)])
    for rank in range(world):
        group.backward(rank, batches[rank])
    group.finish()
    assert all((e._rows_capacity > 0) == rows for e in group.exchanges)  # the path taken
    assert all((e._zero_row is not None) == (vocab < 128) for e in group.exchanges)
    assert all(e.grad_divisor == world for e in group.exchanges)
    grads = [[p.grad for p in m.parameters() if p.requires_grad] for m in group.models]
    for per_rank, alone in zip(zip(*grads), zip(*expected)):
        assert all(torch.equal(g, per_rank[0]) for g in per_rank)  # bitwise: the weights stay equal
        torch.testing.assert_close(per_rank[0], sum(alone[1:], alone[0]), rtol=1e-5, atol=1e-7)
    group.remove()


def test_exchange_refuses_what_it_cannot_send_once():
    """A tied weight that the model does not split (the reference loss: train.fused_loss off)
    would be sent in two parts; a step whose backward did not send every gradient stops before
    anything is added."""
    with pytest.raises(ValueError, match=r"not split \(train.fused_loss off\)"):
        InProcessGroup([build_model("tiny", "gpt_base", seed=0) for _ in range(2)])
    pair = InProcessGroup([fused(build_model("tiny", "gpt_base", seed=0)) for _ in range(2)])
    x = torch.zeros(1, pair.models[0].cfg.block_size, dtype=torch.long)
    pair.backward(0, [(x, x)])
    pair.exchanges[1].begin([x])  # rank 1 runs no backward
    with pytest.raises(RuntimeError, match="not sent exactly once"):
        pair.finish()
    pair.remove()


def test_grad_exchange_setting_is_checked():
    cfg = RunConfig(preset="tiny", train=TrainConfig(grad_exchange="nvlink"))
    with pytest.raises(ConfigError, match=r"train.grad_exchange must be one of \('auto', 'ddp', 'peer'\)"):
        cfg.validate()


@pytest.mark.parametrize(
    "device, world, backend, local, why",
    [
        ("cpu", 2, "gloo", 2, "here on cpu"),
        ("cuda:0", 1, "nccl", 1, "here 1 rank"),
        ("cuda:0", 2, "gloo", 2, "here under gloo"),
        ("cuda:0", 2, "nccl", 1, "here the ranks are on different nodes"),  # torchrun --nnodes 2
        ("cuda:0", 2, "nccl", 2, None),
        ("cuda:0", 4, "nccl", 4, None),  # any number of one host's GPUs (auto: two only)
    ],
)
def test_the_exchange_says_where_it_cannot_run(monkeypatch, device, world, backend, local, why):
    """Why the NVLink exchange steps aside, from what every rank knows alike (no collective): the
    reason the trainer logs, and that grad_exchange: peer's refusal names. Two nodes of one GPU
    each are two ranks under NCCL too, but have no peer memory: LOCAL_WORLD_SIZE tells them."""
    monkeypatch.setattr("torch.distributed.get_world_size", lambda: world)
    monkeypatch.setattr("torch.distributed.get_backend", lambda: backend)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    assert PeerGradExchange.not_here(torch.device(device)) == why


@pytest.mark.parametrize(
    "setting, world, tries_copies", [("auto", 2, True), ("auto", 4, False), ("peer", 4, True), ("ddp", 2, False)]
)
def test_auto_takes_the_copies_on_two_gpus_only(monkeypatch, setting, world, tries_copies):
    """train.grad_exchange auto: the NVLink copies where they were measured to pay (two GPUs), DDP
    on more until they are timed there (benchmarks/README.md); peer asks for them on any number."""
    from oelm_core import distributed

    tried = []
    monkeypatch.setattr("torch.distributed.get_world_size", lambda: world)
    monkeypatch.setattr("torch.distributed.get_backend", lambda: "gloo")
    monkeypatch.setattr(PeerGradExchange, "for_model", classmethod(lambda cls, model, device: tried.append(1)))
    monkeypatch.setattr(distributed, "data_parallel", lambda model, module, tc, device: ("ddp", None))
    model = fused(build_model("tiny", "gpt_base", seed=0))
    tc = TrainConfig(grad_exchange=setting)
    if setting == "peer":
        with pytest.raises(ConfigError, match=r"peer needs CUDA GPUs of one host .* \(here on cpu\)"):
            fast.data_parallel(model, model, tc, torch.device("cpu"))
    else:
        assert fast.data_parallel(model, model, tc, torch.device("cpu")) == ("ddp", None)
    assert bool(tried) == tries_copies
