"""Scratch (CPU): the arithmetic of prof_ddp.py's exchange variants with two exchanges in one
process (tests/test_peer_grads.py's InProcessPair), as that test checks the library's: .grad = the
two ranks' sum, bitwise the same on both, over three steps (the receive buffers reused).
Run from the repository root: python benchmarks/results/8cf8b97/drafts/check_variants.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, "tests")
sys.path.insert(0, ".")
import prof_ddp  # noqa: E402
from test_peer_grads import InProcessPair  # noqa: E402
from oelm_core import build_model  # noqa: E402


def check(cls, variant, vocab, n_micro, batch):
    models = [build_model("tiny", variant, seed=0, vocab_size=vocab) for _ in range(2)]
    pair = InProcessPair(models, cls)
    for step in range(3):
        data = []
        for r in range(2):
            g = torch.Generator().manual_seed(100 * step + r)
            ids = [torch.randint(0, vocab, (batch, 33), generator=g) for _ in range(n_micro)]
            data.append([(t[:, :-1], t[:, 1:]) for t in ids])
        expected = []
        for r in range(2):
            alone = build_model("tiny", variant, seed=0, vocab_size=vocab)  # untapped
            alone.load_state_dict(models[r].state_dict())
            for x, y in data[r]:
                (alone(x, y) / n_micro).backward()
            expected.append([p.grad.clone() for p in alone.parameters() if p.requires_grad])
        for r in range(2):
            models[r].zero_grad(set_to_none=True)
            pair.backward(r, data[r])
        pair.finish()
        got = [[p.grad for p in m.parameters() if p.requires_grad] for m in models]
        worst = 0.0
        for a, b, e0, e1 in zip(got[0], got[1], expected[0], expected[1]):
            assert torch.equal(a, b), "ranks differ"
            worst = max(worst, float((a - (e0 + e1)).abs().max()))
        assert worst < 1e-5, worst
        with torch.no_grad():  # a step, so that the next one differs
            for m in models:
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
        print(f"{cls.__name__:16s} {variant:14s} micro {n_micro} batch {batch} step {step}: "
              f"bitwise equal on both ranks, {worst:.1e} from the sum", flush=True)


for cls in (prof_ddp.BodyEarly, prof_ddp.NoMask, prof_ddp.Both, prof_ddp.PeerGradExchange):
    cls.GROUP_MB = 0.001  # several groups even at tiny
    check(cls, "oelm_freeze", 120, 1, 1)  # rows (2 x 32 <= 128), padded 128 > 120
    check(cls, "gpt_base", 120, 2, 2)     # dense
    check(cls, "oelm_nofreeze", 120, 2, 1)  # rows, accumulated
