"""train.deterministic on a GPU: one configuration trained twice gives the same bits.

Without it two identical Medium-512 runs on one H200 ended 0.007 nats apart in best validation loss
(2.2925 and 2.2992, 2026-11-29), as two seeds do; with it, two ended on the same bits.
"""

import json

import pytest
import torch
from train_helpers import params, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("no_data_override"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the nondeterministic kernels are CUDA's"),
]


def test_two_deterministic_runs_are_bit_identical(tmp_path, folded):
    """The whole step at Medium-512's width and context in bf16, with the CUDA graph and the fused
    loss (the CLI's defaults): every logged loss, gradient norm and validation loss, and the best
    weights, equal between two runs of one configuration. (The validation file holds one window
    of 513 tokens: no held-out half.)"""
    common = dict(
        steps=40,
        batch_size=8,
        eval_every=10,
        eval_batches=2,
        ckpt_every=40,
        device="cuda",
        log_every=1,
        deterministic=True,
        report_holdout=False,
    )
    runs = []
    for name in ("first", "second"):
        values = params(tmp_path, folded, out=name, **common)
        values["model"].update(block_size=512, d_model=512, n_head=8, d_ff=2048)
        run(values)
        runs.append(tmp_path / name)
    rows = [[json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    keys = ("step", "train_loss", "grad_norm", "val_loss")
    assert [[row.get(k) for k in keys] for row in rows[0]] == [[row.get(k) for k in keys] for row in rows[1]]
    assert len(rows[0]) == 40
    a, b = (torch.load(r / "best.pt", map_location="cpu", weights_only=True)["model"] for r in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
