"""DDP's tied embedding/output gradient in two shares (oelm_core.fast.tied_grads): the split
that the fused loss offers, and the reducer's result against the mean of the ranks' gradients."""

import os
import subprocess
import sys

import pytest
import torch

from oelm_core import fast
from oelm_core.config import TrainConfig
from oelm_core.fast.tied_grads import split_tied_gradient
from oelm_core.model import build_model
from train_helpers import REPO, free_port


def test_split_tied_gradient_hands_over_the_output_share():
    """The hook gets the output layer's share of the tied weight's gradient; wte.grad keeps the
    embedding's, zero outside the batch's tokens; together exactly the plain gradient. Nothing
    to split with an untied output layer or the reference loss (train.fused_loss off)."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    # 3 x 32 tokens: 3 slices of the fused loss
    model = fast.apply(build_model("tiny", "gpt_base"), TrainConfig(loss_chunk_tokens=40), cpu)
    idx, tgt = torch.randint(0, 100, (3, 32)), torch.randint(0, 128, (3, 32))
    model(idx, tgt).backward()
    plain = model.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    shares = []
    assert split_tied_gradient(model, shares.append) is model.wte.weight
    assert model.output_loss.grad_hook == shares.append
    (0.5 * model(idx, tgt)).backward()  # the hook's share is scaled like any gradient
    (out,), emb = shares, model.wte.weight.grad
    assert out.dtype == torch.float32 and out.shape == plain.shape
    assert (out + emb - 0.5 * plain).abs().max().item() < 1e-7
    unused = torch.ones(emb.size(0), dtype=torch.bool)
    unused[idx.flatten()] = False
    assert emb[unused].abs().max().item() == 0.0 and emb[~unused].abs().min().item() > 0
    assert out[unused].abs().max().item() > 0  # the output layer touches every row
    assert split_tied_gradient(model, None) is model.wte.weight and model.output_loss.grad_hook is None
    model.zero_grad(set_to_none=True)
    model(idx, tgt).backward()
    assert torch.equal(model.wte.weight.grad, plain)
    untied = fast.apply(build_model("tiny", "gpt_base", tie_embeddings=False), TrainConfig(), cpu)
    for model in (untied, build_model("tiny", "gpt_base")):  # nothing to split
        assert split_tied_gradient(model, shares.append) is None


TIED_REDUCER = """import sys, torch, torch.distributed as dist
from oelm_core import fast
from oelm_core.config import TrainConfig
from oelm_core.fast.tied_grads import TiedGradReducer
from oelm_core.model import build_model
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
seq = int(sys.argv[1])
tc, cpu = TrainConfig(loss_chunk_tokens=48), torch.device("cpu")
split, plain = (fast.apply(build_model("tiny", "gpt_base", block_size=64), tc, cpu) for _ in range(2))
reducer = TiedGradReducer.for_model(split)
gen = torch.Generator().manual_seed(rank)
batches = [torch.randint(0, 40, (2, seq + 1), generator=gen) for _ in range(2)]
reducer.begin([b[:, :-1] for b in batches])
for i, b in enumerate(batches):
    reducer.sync = i == 1
    (split(b[:, :-1], b[:, 1:]) / 2).backward()
    (plain(b[:, :-1], b[:, 1:]) / 2).backward()
    # the rows leave during the last micro-step's backward, once the embedding's share is written
    assert (reducer._rows_work is not None) == (i == 1 and reducer._ids is not None), i
reducer.finish()
got, mine = split.wte.weight.grad, plain.wte.weight.grad
everyone, expected = [torch.empty_like(got) for _ in range(world)], torch.empty_like(mine)
dist.all_gather(everyone, got)
dist.all_reduce(mine)
assert all(torch.equal(g, got) for g in everyone), "ranks differ"
err = ((got - mine / world).abs().max() / mine.abs().max()).item()
assert err < 1e-6, err
if rank == 0:
    print("rows" if world * 4 * seq <= got.size(0) else "dense", err)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("seq, path", [(8, "rows"), (48, "dense")])
def test_tied_gradient_reducer_equals_the_mean_gradient(tmp_path, seq, path):
    """Two gloo ranks: the tied weight's gradient from TiedGradReducer (output share all-reduced,
    embedding share as gathered rows, or dense when the tokens outnumber the rows) equals the
    mean of the ranks' plain gradients, over two micro-steps, and is the same on both ranks."""
    script = tmp_path / "tied.py"
    script.write_text(TIED_REDUCER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           str(script), str(seq)],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == path, proc.stdout

