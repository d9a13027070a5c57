# %% [markdown]
# # 04 · Analysis: results, hypotheses, attention
#
# Loads any number of run folders (several seeds per group give means, sample standard deviations,
# 95% intervals of the gaps and Welch t-tests; a group is the runs of one variant trained with the
# same settings apart from the seed), draws each group's mean curves with a band, builds the
# results table in the original study's form, judges hypotheses H1–H4 from the data, compares
# attention maps and samples, and writes `results.md` / `results.json` to `out_dir`.
#
# `compare_across`: the settings the groups compared may differ in, for a study whose groups each
# trained at its own tuned setting (`["train.lr", "train.min_lr", "model.dropout"]`, what
# `make results` passes for results/tuned_medium512); empty, groups are compared only where they
# differ in the variant alone. `timed_alone`: False for runs that shared their GPUs (several trainings
# on one card): their tokens/s and seconds are then shares of a GPU, so H3 is not judged and the
# time-based views are left out. `tuning_choice` ({variant: dropout}, what `python -m oelm_core tune
# --per-dropout` writes into a protocol study): the study holds each group at its best learning rate
# at each dropout; results.md reads it on equal footing (each group at its own best dropout, and
# all groups at each dropout), and the sections below show the own-best view.

# %% tags=["parameters"]
run_dirs = []  # run folders, or folders that hold them (a study folder)
out_dir = "runs/notebooks/analysis"  # a relative path is taken from the repository root
fig_dir = None  # None: <out_dir>/figures
which = "final"  # 'final', 'best' or 'report' (the held-out half; runs with train.report_holdout)
compare_across = []  # settings the compared groups may differ in (tuned groups: lr, min_lr, dropout)
timed_alone = True  # False: the runs shared GPUs, speed not compared; True asserts nothing (records decide)
tuning_choice = {}  # {variant: dropout} of a study tuned per dropout (issue 42's protocol); {}: none
attention_text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun."
layer = 0
head = 0
max_tokens = 24
sample_prompt = "Once upon a time"
max_new_tokens = 40

# %%
# Paths in the parameters (parameter files, out_dir, the data cache) are taken from the repository
# root, as on the command line: a kernel that JupyterLab starts in notebooks/ moves there.
import os
import sys
from pathlib import Path

if Path.cwd().name == "notebooks" and (Path.cwd().parent / "oelm_core").is_dir():
    os.chdir(Path.cwd().parent)
if (Path.cwd() / "oelm_core").is_dir() and str(Path.cwd()) not in sys.path:
    sys.path.insert(0, str(Path.cwd()))  # this checkout's oelm_core, installed or not
from IPython.display import Markdown, display

# %matplotlib inline
from oelm_core.notebooks import check_kernel_parameters

check_kernel_parameters("04_analysis", globals())  # what papermill injected, too
from oelm_core import analysis as A

out_dir = A.REPO / out_dir  # an absolute path stays as it is
fig_dir = A.REPO / fig_dir if fig_dir else out_dir / 'figures'
runs = all_runs = A.load_runs(run_dirs)
if tuning_choice:
    protocol = A.protocol_report(runs, out_dir, tuning_choice, which, timed_alone=timed_alone)
    display(Markdown((out_dir / 'results.md').read_text()))
    own_best = protocol['views']['own best']
    runs = [r for r in runs if r.name in own_best['runs']]
    compare_across = own_best['compare_across']
display(
    Markdown(
        A.markdown_table(
            [
                {
                    'run': r.name,
                    'variant': r.variant,
                    'preset': r.preset,
                    'seed': r.seed,
                    'steps': r.value('steps'),
                    'folder': str(r.path),
                }
                for r in runs
            ]
        )
    )
)

# %% [markdown]
# ## Training and validation curves
#
# Each group's mean over its seeds, with a band of +-1 sample standard deviation (n-1); epochs on
# the top axis; the last third of the steps enlarged; and the validation loss against training
# seconds (evaluation excluded), the compute-matched view: every run trained alone on one GPU
# (with `timed_alone` False that panel is left empty).

# %%
title = 'Each group at its own best setting' if tuning_choice else None
display(A.plot_study_curves(runs, fig_dir / 'curves.png', timed_alone=timed_alone, title=title))
if tuning_choice:  # a view of other runs than the own-best ones (all groups at one dropout): its curves too
    for name, view in protocol['views'].items():
        if set(view['runs']) != set(own_best['runs']):
            display(Markdown(f'### {name}'))
            shown = [r for r in all_runs if r.name in view['runs']]
            path = fig_dir / f"curves_{name.replace('=', '').replace(' ', '_')}.png"
            title = f"All groups at {name.replace('=', ' ')}"
            display(A.plot_study_curves(shown, path, timed_alone=timed_alone, title=title))

# %% [markdown]
# ## Results table
#
# Gaps are relative to GPT-Base of the same preset (positive: worse); where the preset has several
# GPT-Base groups, to the one trained with the row's settings apart from the variant. A variant's
# runs trained with other settings (per-run overrides, an unfreeze schedule) are rows of their
# own, named after their runs.

# %%
table = A.results_table(runs, which, compare_across=compare_across)
display(Markdown(table['markdown']))

# %% [markdown]
# ## Gaps with 95% intervals
#
# Per group the mean and sample standard deviation (n-1) of the validation loss and PPL; per pair
# the PPL gap exp(mean loss A - mean loss B) - 1 (of the geometric-mean PPLs) with its 95% Welch
# and bootstrap intervals (of the loss difference, mapped through exp(.) - 1), Hedges' g and
# Cohen's d of the losses.

# %%
gaps = A.gap_table(runs, which, compare_across)
display(Markdown(gaps['markdown']))

# %% [markdown]
# ## Hypotheses
#
# * **H1** freezing cuts trainable parameters by ~15% (the original report's claim; the exact
#   figure at medium512 is 7.0% of all parameters, 16.6% of the non-embedding ones)
# * **H2** OELM-Freeze perplexity within 5% of OELM-NoFreeze
# * **H3** OELM-Freeze trains at least as fast as OELM-NoFreeze (tokens/s), and **H3t** reaches a
#   target validation loss in at most OELM-NoFreeze's training time; judged only where every run's
#   summary.json records that it had its device alone
# * **H4** OELM-Freeze perplexity within 10% of GPT-Base
#
# H2 and H4 are judged on the gap's 95% Welch interval: "not decided at this n" where it spans
# the threshold. Each compares two groups trained with the same settings apart from the variant
# (and `compare_across`); where the runs hold no such pair, or several, the hypothesis is not
# judged and its evidence says why.

# %%
hyps = A.hypotheses(runs, which, compare_across=compare_across, timed_alone=timed_alone)
display(Markdown(A.hypotheses_markdown(hyps)))
assert [h['id'] for h in hyps] == ['H1', 'H2', 'H3', 'H3t', 'H4']
assert not A.unjudged(hyps, runs, compare_across, timed_alone), hyps

# %% [markdown]
# ## Steps and training time to a target validation loss
#
# The target is the highest validation loss of any run, so that every run reaches it; training
# seconds are summed over the log windows (tokens / tokens_per_s), evaluation excluded.

# %%
groups = A.group_runs(runs)
target = A.loss_target(groups, which)
record = A.alone_record(runs)
if not timed_alone or record['alone'] is not True:
    display(Markdown(f"(not compared: {record['why'] or 'the runs shared their GPUs (timed_alone=False)'})"))
elif target is None:
    display(Markdown('(no evaluations)'))
else:
    display(Markdown(A.time_to_target_table(groups, target)['markdown']))

# %% [markdown]
# ## Significance across seeds
#
# Welch's t-test and Cohen's d of the validation perplexity, where each group has at least two
# seeds.

# %%
sig = A.significance_tests(runs, f'{which}_val_ppl', compare_across=compare_across)
columns = ['a', 'b', 'preset', 'n_a', 'n_b', 'mean_a', 'mean_b', 't', 'p', 'cohen_d']
display(Markdown(A.markdown_table(sig, columns) if sig else '(no groups to compare)'))

# %% [markdown]
# ## Attention maps on the same story

# %%
models = A.load_models(runs)
display(Markdown(A.checkpoint_note(which)))
if models:
    display(A.attention_figure(models, attention_text, layer, head, max_tokens, fig_dir / 'attention.png'))
    summary = {label: A.attention_summary(m, attention_text, max_tokens) for label, m in models.items()}
    display(Markdown(A.markdown_table([{'model': label, **row} for label, rows in summary.items() for row in rows])))

# %% [markdown]
# ## Samples

# %%
samples = A.sample_generations(models, sample_prompt, max_new_tokens)
display(Markdown(A.markdown_table(samples) if samples else '(no checkpoints)'))

# %% [markdown]
# ## Written results

# %%
if tuning_choice:  # results.md and .json are protocol_report's (first cell); the samples join them
    with open(out_dir / 'results.md', 'a') as f:
        f.write('\n' + A.samples_markdown(samples, which) + '\n' if samples else '')
else:
    A.write_results(
        runs,
        out_dir,
        which,
        extra_markdown=A.samples_markdown(samples, which),
        compare_across=compare_across,
        timed_alone=timed_alone,
    )
assert (out_dir / 'results.md').is_file() and (out_dir / 'results.json').is_file()
print((out_dir / 'results.md').read_text())
