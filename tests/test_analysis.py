"""oelm_core.analysis on hand-made run folders and known numbers."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from oelm_core import analysis as A
from oelm_core import build_model, count_parameters
from oelm_core.config import model_config

MEDIUM = {"gpt_base": (44_896_768, 0), "oelm_nofreeze": (44_896_768, 0), "oelm_freeze": (41_751_040, 3_145_728)}


def make_run(root: Path, variant: str, ppl: float, tok_s: float = 1000.0, seed: int = 42,
             preset: str = "medium512", train_loss: float = 2.0, summary: bool = True) -> Path:
    """A run folder as oelm_core.train writes it, with the given figures."""
    d = root / f"{variant}_s{seed}"
    d.mkdir(parents=True)
    trainable, frozen = MEDIUM[variant]
    loss = math.log(ppl)
    (d / "config.yaml").write_text(yaml.safe_dump({"name": d.name, "variant": variant, "preset": preset,
                                                   "train": {"seed": seed}}))
    rows = []
    for step in (10, 20, 30, 40):
        row = {"step": step, "train_loss": train_loss + (40 - step) / 10, "lr": 1e-3, "grad_norm": 1.0,
               "tokens_per_s": tok_s, "mfu": None, "peak_mem_mb": None, "tokens_seen": step * 512,
               "epochs": step / 100}
        if step % 20 == 0:
            row.update(val_loss=loss + (40 - step) / 20, val_ppl=math.exp(loss + (40 - step) / 20),
                       val_bpb=loss / 3)
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        (d / "summary.json").write_text(json.dumps({
            "name": d.name, "variant": variant, "preset": preset, "status": "completed",
            "params": {"trainable": trainable, "frozen": frozen, "total": trainable + frozen},
            "steps": 40, "final_val_loss": loss, "final_val_ppl": ppl, "final_val_bpb": loss / 3,
            "best_val_loss": loss, "best_val_ppl": ppl, "best_val_bpb": loss / 3,
            "final_train_loss": train_loss, "tokens_per_s": tok_s, "wall_time_s": 12.0,
            "epochs": 0.4, "checkpoint_bytes": 2**20 * 500}))
    return d


def study_runs(tmp_path, base=10.0, nofreeze=10.2, freeze=10.5, tok=(1000, 1000, 1010)):
    make_run(tmp_path, "gpt_base", base, tok[0])
    make_run(tmp_path, "oelm_nofreeze", nofreeze, tok[1])
    make_run(tmp_path, "oelm_freeze", freeze, tok[2])
    return A.load_runs(tmp_path)


def verdicts(hyps):
    return {h["id"]: h["holds"] for h in hyps}


# --- reading runs -------------------------------------------------------------------------------

def test_load_run_reads_summary_metrics_and_config(tmp_path):
    run = A.load_run(make_run(tmp_path, "oelm_freeze", 12.0, seed=7))
    assert (run.variant, run.preset, run.seed, run.label) == ("oelm_freeze", "medium512", 7, "OELM-Freeze")
    assert len(run.train_rows()) == 4 and [r["step"] for r in run.eval_rows()] == [20, 40]
    assert run.value("final_val_ppl") == 12.0 and run.value("trainable") == 41_751_040
    assert run.value("wall_time_s") == 12.0 and run.value("steps") == 40 and run.value("epochs") == 0.4


def test_checkpoint_mb_is_the_size_of_best_pt(tmp_path):
    """summary.json's checkpoint_bytes (500 MiB here) is the newest training checkpoint, AdamW
    moments included; the table's checkpoint is best.pt, the weights, in MB of 10^6 bytes,
    whether summary.json exists or not."""
    import dataclasses

    from oelm_core.checkpoint import load_model, save_checkpoint

    model = build_model("tiny", "oelm_freeze")
    with_summary = make_run(tmp_path, "oelm_freeze", 12.0)
    save_checkpoint({"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg)},
                    with_summary / "best.pt")
    assert load_model(with_summary / "best.pt")[0].cfg == model.cfg
    size = (with_summary / "best.pt").stat().st_size
    assert size != 500 * 2**20
    assert A.load_run(with_summary).value("checkpoint_mb") == pytest.approx(size / 1e6)
    without_summary = make_run(tmp_path, "gpt_base", 10.0, summary=False)
    (without_summary / "best.pt").write_bytes(b"\0" * 2_500_000)
    assert A.load_run(without_summary).value("checkpoint_mb") == 2.5
    runs = A.load_runs(tmp_path)
    rows = {r["variant"]: r for r in A.results_table(runs)["rows"]}
    assert rows["oelm_freeze"]["checkpoint_mb"] == pytest.approx(size / 1e6)
    assert rows["gpt_base"]["checkpoint_mb"] == 2.5
    # no best.pt: no checkpoint size, not the training checkpoint's
    assert A.load_run(make_run(tmp_path, "oelm_nofreeze", 11.0)).value("checkpoint_mb") is None


def test_committed_results_load_with_the_trainers_keys():
    """The committed run folders (summary.json as oelm_core.train writes it) give every figure."""
    runs = A.load_runs(Path(__file__).resolve().parents[1] / "results" / "ablations")
    assert len(runs) == 30
    for run in runs:
        for key in ("final_val_loss", "final_val_ppl", "final_val_bpb", "best_val_loss", "best_val_ppl",
                    "final_train_loss", "tokens_per_s", "trainable", "total", "wall_time_s",
                    "epochs", "steps"):
            assert run.value(key) is not None, (run.path, key)
        assert run.value("final_val_ppl") == pytest.approx(math.exp(run.value("final_val_loss")))
        assert run.value("steps") == run.metrics[-1]["step"]


def test_values_fall_back_to_metrics_without_summary(tmp_path):
    d = make_run(tmp_path, "gpt_base", 10.0, tok_s=500, summary=False)
    (d / "metrics.jsonl").write_text((d / "metrics.jsonl").read_text() + '{"step": 50, "train_lo')  # torn line
    run = A.load_run(d)
    assert run.value("final_val_loss") == pytest.approx(math.log(10.0))
    assert run.value("final_val_ppl") == pytest.approx(10.0)
    assert run.value("best_val_loss") == pytest.approx(math.log(10.0))
    assert run.value("final_train_loss") == pytest.approx(2.0)
    assert run.value("tokens_per_s") == pytest.approx(500)


def test_load_runs_finds_run_folders_below_a_study(tmp_path):
    study_runs(tmp_path / "study" / "runs")
    runs = A.load_runs(tmp_path / "study")
    assert sorted(r.variant for r in runs) == ["gpt_base", "oelm_freeze", "oelm_nofreeze"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no run folders"):
        A.load_runs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        A.load_run(tmp_path / "missing")


# --- table and hypotheses -----------------------------------------------------------------------

def test_results_table_gaps_and_per_parameter(tmp_path):
    table = A.results_table(study_runs(tmp_path))
    rows = {r["variant"]: r for r in table["rows"]}
    assert [r["variant"] for r in table["rows"]] == ["gpt_base", "oelm_nofreeze", "oelm_freeze"]
    assert rows["gpt_base"]["ppl_gap_pct"] == pytest.approx(0.0)
    assert rows["oelm_freeze"]["ppl_gap_pct"] == pytest.approx(5.0)
    assert rows["oelm_freeze"]["loss_gap_pct"] == pytest.approx(100 * (math.log(10.5) / math.log(10) - 1))
    assert rows["oelm_freeze"]["ppl_per_m_trainable"] == pytest.approx(10.5 / 41.75104)
    assert rows["oelm_freeze"]["trainable_params"] == 41_751_040
    assert "| OELM-Freeze |" in table["markdown"] and "41,751,040" in table["markdown"]


def test_hypotheses_judged_honestly_and_flip_with_the_data(tmp_path):
    hyps = A.hypotheses(study_runs(tmp_path / "a"))
    assert [h["id"] for h in hyps] == ["H1", "H2", "H3", "H4"]
    assert set(hyps[0]) >= {"id", "claim", "value", "threshold", "holds", "evidence"}
    # H1: 7.0% is not ~15%
    assert hyps[0]["value"] == pytest.approx(3_145_728 / 44_896_768) and hyps[0]["holds"] is False
    assert "7.0%" in hyps[0]["evidence"]
    assert verdicts(hyps) == {"H1": False, "H2": True, "H3": True, "H4": True}
    # Freeze 8% worse than NoFreeze, 12% worse than Base, 10% slower: H2, H3, H4 flip
    bad = A.hypotheses(study_runs(tmp_path / "b", base=10.0, nofreeze=10.37, freeze=11.2,
                                  tok=(1000, 1000, 900)))
    assert verdicts(bad) == {"H1": False, "H2": False, "H3": False, "H4": False}
    assert bad[1]["value"] == pytest.approx(11.2 / 10.37 - 1)
    # H1 holds with a claim that matches the data
    assert A.hypotheses(study_runs(tmp_path / "c"), h1_claim=0.07)[0]["holds"] is True


def test_which_other_than_final_or_best_is_refused(tmp_path):
    """which='bestt' read no figures: an empty table and unjudged hypotheses, which only a later
    assertion in the analysis notebook caught."""
    from oelm_core.config import ConfigError

    runs = study_runs(tmp_path)
    for call in (A.results_table, A.hypotheses, lambda r, w: A.write_results(r, tmp_path / "out", w)):
        with pytest.raises(ConfigError, match=r"which='bestt' names no validation figures; pass one of 'final', 'best'"):
            call(runs, "bestt")
    assert not (tmp_path / "out").exists()
    assert A.results_table(runs, "best")["rows"][2]["val_ppl"] == pytest.approx(10.5)


def test_hypotheses_without_the_runs_they_need_are_not_judged(tmp_path):
    make_run(tmp_path, "gpt_base", 10.0)
    hyps = A.hypotheses(A.load_runs(tmp_path))
    assert all(h["holds"] is None and "not judged" in h["evidence"] for h in hyps)


# --- significance ---------------------------------------------------------------------------------

def test_welch_matches_scipy_and_cohens_d_known_values():
    from scipy import stats

    a, b = [10.1, 10.4, 9.9, 10.3], [10.9, 11.2, 10.6]
    res = A.significance(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert res["t"] == pytest.approx(ref.statistic) and res["p"] == pytest.approx(ref.pvalue)
    # Cohen's d with the pooled sd, by hand
    assert A.significance([1, 2, 3], [4, 5, 6])["cohen_d"] == pytest.approx(-3.0)
    assert A.significance([2, 4], [1, 3])["cohen_d"] == pytest.approx(1 / math.sqrt(2))
    one = A.significance([1.0], [2.0, 3.0])
    assert one["t"] is None and one["p"] is None and one["cohen_d"] is None


def test_seed_groups_give_mean_std_and_tests(tmp_path):
    for seed, (pb, pf) in enumerate([(10.0, 10.6), (10.2, 10.8), (9.8, 10.7)]):
        make_run(tmp_path, "gpt_base", pb, seed=seed)
        make_run(tmp_path, "oelm_freeze", pf, seed=seed)
    runs = A.load_runs(tmp_path)
    rows = {r["variant"]: r for r in A.results_table(runs)["rows"]}
    assert rows["gpt_base"]["seeds"] == 3
    assert rows["gpt_base"]["val_ppl"] == pytest.approx(10.0)
    assert rows["gpt_base"]["val_ppl_std"] == pytest.approx(0.2)
    sig = A.significance_tests(runs)
    assert len(sig) == 1 and sig[0]["a"] == "OELM-Freeze" and sig[0]["p"] < 0.05
    out = A.write_results(runs, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["significance"][0]["n_a"] == 3 and len(data["hypotheses"]) == 4
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Welch" in md and "H4" in md and out["table"]


def test_plot_curves_saves_and_closes(tmp_path):
    import matplotlib.pyplot as plt

    runs = study_runs(tmp_path / "runs")
    before = len(plt.get_fignums())
    A.plot_curves(runs, tmp_path / "fig" / "curves.png")
    assert (tmp_path / "fig" / "curves.png").stat().st_size > 1000
    assert len(plt.get_fignums()) == before


# --- theory and model accounts ------------------------------------------------------------------

def test_theory_tables_separate_orthogonal_from_gaussian():
    iso = {r["method"]: r for r in A.isometry_table(64, 32)}
    assert iso["qr"]["isometry_error"] < 1e-10 and iso["cayley"]["condition_number"] == pytest.approx(1)
    assert iso["gaussian"]["orthogonality_error"] > 0.5
    jl = A.jl_curve(64, 16, ks=(4, 32), trials=2)
    assert {r["method"] for r in jl} == {"qr", "gaussian"} and len(jl) == 4
    logits = {r["init"]: r for r in A.logit_stats_table(64, 4, 16)}
    assert logits["normal"]["logit_std"] < 0.2 < logits["qr"]["logit_std"]


def test_parameter_table_medium512_exact():
    rows = {r["variant"]: r for r in A.parameter_table("medium512", A.GROUP_LABELS)}
    for v, (trainable, frozen) in MEDIUM.items():
        assert (rows[v]["trainable"], rows[v]["frozen"]) == (trainable, frozen)
    assert rows["oelm_freeze"]["trainable_reduction"] == pytest.approx(0.0700, abs=5e-4)


@pytest.mark.parametrize("overrides", [{}, {"bias": False, "attn_bias": True, "tie_embeddings": False}])
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_analytic_parameters_equal_count_parameters(variant, overrides):
    cfg = model_config("tiny", variant, **overrides)
    counted = count_parameters(build_model(cfg))
    assert A.analytic_parameters(cfg) == {k: counted[k] for k in ("trainable", "frozen", "total")}
    rows = A.shape_account()  # Medium-512
    assert [r["total"] for r in rows] == [44_896_768] * 3
    assert rows[2]["trainable"] == 41_751_040 and rows[2]["trainable_reduction_pct"] == pytest.approx(7.0, abs=0.01)


@pytest.mark.parametrize("variant, message", [
    ("oelm_poet", r"POET \(poet_block_size=32\) learns Q/K through R and P"),
    ("synth_random", "attention 'synth_random' has no Q/K"),
])
def test_analytic_parameters_refuse_what_they_do_not_count(variant, message):
    """POET trains R, P and freezes W0; the Synthesizer has logit tables instead of Q/K: the
    plain-Q/K formula gave wrong counts for both, without a word."""
    cfg = model_config("tiny", variant)
    with pytest.raises(ValueError, match=message + r".*count_parameters\(build_model\(cfg\)\)"):
        A.analytic_parameters(cfg)


def test_gradient_flow_check_frozen_qk_get_no_gradient():
    flow = A.gradient_flow_check("tiny", "oelm_freeze")
    assert len(flow["frozen_qk"]) == 2 and flow["frozen_without_grad"] and flow["qk_unchanged_by_step"]
    assert flow["trainable_with_grad"] and flow["trainable_qk_in_frozen_layers"] == []
    assert A.gradient_flow_check("tiny", "gpt_base")["frozen_qk"] == []


def test_gradient_flow_check_catches_trainable_qk_in_a_frozen_layer(monkeypatch):
    """A model whose layer-1 Q/K the config freezes but which trains them anyway must fail the
    check (the old checks looked only at the buffers, so they held by construction)."""
    import oelm_core

    def broken(*args, **kwargs):
        model = build_model(*args, **kwargs)
        model.unfreeze_qk([1])
        return model

    monkeypatch.setattr(oelm_core, "build_model", broken)
    flow = A.gradient_flow_check("tiny", "oelm_freeze")
    assert not flow["frozen_without_grad"] and not flow["qk_unchanged_by_step"]
    assert flow["frozen_qk"] == ["blocks.0.attn.qk.weight"]
    assert flow["trainable_qk_in_frozen_layers"] == ["blocks.1.attn.qk.weight"]
    assert flow["trainable_with_grad"]  # the trainable copy does get its gradient


def test_attention_summary_rows_are_within_bounds():
    model = build_model("tiny", "oelm_freeze").eval()
    ids = list(range(10))
    rows = A.attention_summary(model, ids)
    assert len(rows) == model.cfg.n_layer * model.cfg.n_head
    for r in rows:
        assert 0 <= r["entropy"] <= math.log(10) + 1e-6 and 0 <= r["mean_distance"] <= 9


def test_attention_maps_refuse_empty_and_over_long_input():
    """An empty text was a torch indexing error; one longer than the context was silently cut
    to its first block_size tokens. max_tokens is the explicit cut, to the first tokens."""
    model = build_model("tiny", "oelm_freeze").eval()  # context of 32 tokens
    with pytest.raises(ValueError, match="no tokens to compute attention over: the text is empty"):
        A.attention_maps(model, "")
    with pytest.raises(ValueError, match=r"max_tokens=0 keeps no tokens; pass max_tokens >= 1"):
        A.attention_summary(model, [1, 2], max_tokens=0)
    long = list(range(40))
    with pytest.raises(ValueError, match=r"40 tokens exceed the model's context of 32; pass max_tokens=32"):
        A.attention_summary(model, long)
    ids, maps = A.attention_maps(model, long, max_tokens=32)
    assert ids == long[:32] and maps[0].shape == (2, 32, 32)
    with pytest.raises(ValueError, match="40 tokens exceed the model's context of 32"):
        A.attention_maps(model, long, max_tokens=100)


class UniformAttention(torch.nn.Module):
    """Stands in for a GPT whose every head attends uniformly to the past."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.cfg = type("Cfg", (), {"block_size": 16})()

    def forward_with_attention(self, idx):
        t = idx.shape[1]
        att = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
        return None, [att.expand(1, 2, t, t)]


def test_attention_summary_known_values():
    t = 4
    rows = A.attention_summary(UniformAttention(), list(range(t)))
    assert len(rows) == 2
    # query i spreads over i+1 keys: entropy log(i+1), mean distance i/2
    assert rows[0]["entropy"] == pytest.approx(sum(math.log(i) for i in range(1, t + 1)) / t)
    assert rows[1]["mean_distance"] == pytest.approx(sum(i / 2 for i in range(t)) / t)


def test_attention_figure_and_samples_with_gpt2_vocab(tmp_path):
    models = {"GPT-Base": build_model("smoke", "gpt_base").eval(),
              "OELM-Freeze": build_model("smoke", "oelm_freeze").eval()}
    fig = A.attention_figure(models, "Once upon a time there was a cat.", 1, 3, 12, tmp_path / "att.png")
    assert len(fig.axes) == 2 and (tmp_path / "att.png").is_file()
    samples = A.sample_generations(models, "Once upon a time", max_new_tokens=5, seed=1)
    assert [s["model"] for s in samples] == ["GPT-Base", "OELM-Freeze"]
    assert samples == A.sample_generations(models, "Once upon a time", max_new_tokens=5, seed=1)
