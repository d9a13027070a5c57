"""The study's groups, and which runs are seeds of one setup.

A results table averages the seeds of one setup: runs of one variant and preset trained with the
same settings apart from train.seed. Runs of one variant trained otherwise (another learning
rate, an unfreeze schedule) are a group of their own, never averaged as if they were seeds; and
two groups are compared (gaps, hypotheses, tests) only where they differ in the variant alone.

A study of tuned groups is the one deliberate exception: each group trained at its own best
learning rate and dropout (oelm_core.tuning's sweep), so their gap is the variants' gap at each
one's tuned setting, not at a shared one. Its analysis passes ``compare_across=TUNED_SETTINGS``:
those settings may then differ between the groups compared, and every other (steps, batch, data,
schedule, ...) must still match. Every other study keeps the strict default, ``compare_across=()``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from oelm_core.analysis.stats import mean_std
from oelm_core.config import PRESETS, ConfigError, model_config, variant_overrides
from oelm_core.groups import BASELINE, GROUP_LABELS  # noqa: F401 (the analysis' modules read them here)

if TYPE_CHECKING:
    from oelm_core.analysis.runs import Run

# The settings that oelm_core.tuning tunes per group: what a study of tuned groups compares across
# (``variant_alone``'s compare_across). min_lr is tied to lr (a tenth of it) and so tuned with it.
TUNED_SETTINGS = ("train.lr", "train.min_lr", "model.dropout")
# The fields of a preset that name a model's shape (Group.shape).
SHAPE_FIELDS = ("n_layer", "d_model", "n_head", "d_ff", "block_size")


@dataclass
class Group:
    """The seeds of one setup: runs of one variant and preset whose trained settings
    (Run.settings) are equal apart from train.seed."""

    label: str  # what the tables call it (group_runs)
    variant: str
    preset: str
    settings: dict  # Run.settings() without train.seed
    runs: list[Run] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # runs[i] trained with seeds[i]

    def mean(self, key: str) -> float | None:
        """The mean of the runs' ``key`` figure (Run.value) over the seeds that have it."""
        return mean_std([r.value(key) for r in self.runs])[0]

    @property
    def shape(self) -> str:
        """The preset's name, and where the runs trained another shape than the preset's (a shape
        study's runs keep Medium-512's parameter files and set the model's width), the fields
        that differ: "medium512", "medium512 at d_model 384, n_head 6, d_ff 1536"."""
        changed = [
            f"{k} {self.settings[f'model.{k}']}"
            for k in SHAPE_FIELDS
            if f"model.{k}" in self.settings and self.settings[f"model.{k}"] != PRESETS.get(self.preset, {}).get(k)
        ]
        return f"{self.preset} at {', '.join(changed)}" if changed and self.preset in PRESETS else self.preset


def seed_groups(runs: Sequence[Run], keys: Sequence) -> list[tuple[Any, dict, list[int]]]:
    """The positions of ``runs`` as groups of seeds, in the order first met: runs of one key
    (``keys[i]`` is ``runs[i]``'s) whose trained settings (Run.settings) are equal apart from
    train.seed. Each group is (key, those settings without train.seed, positions). A run without
    config.yaml has an unknown seed (Run.seed None) and is taken to have trained its variant's
    default settings (the tables name it: assumed_settings). ConfigError for two runs of one
    group with the same seed: the same training twice, not two seeds."""
    groups: list[tuple[Any, dict, list[int]]] = []
    for i, (run, key) in enumerate(zip(runs, keys)):
        settings = run.settings()
        del settings["train.seed"]
        group = next((g for g in groups if (g[0], g[1]) == (key, settings)), None)
        if group is None:
            group = (key, settings, [])
            groups.append(group)
        twin = next((runs[j] for j in group[2] if run.seed is not None and runs[j].seed == run.seed), None)
        if twin is not None:
            raise ConfigError(
                f"{twin.path} and {run.path} trained the same settings with the same seed "
                f"({run.seed}): the same run twice, not two seeds of one; leave one of them out "
                f"of the runs read"
            )
        group[2].append(i)
    return groups


def group_runs(runs: Iterable[Run]) -> list[Group]:
    """The runs as groups of seeds, by preset, then GPT-Base, OELM-NoFreeze, OELM-Freeze, others.

    Runs of one variant trained otherwise (per-run overrides, an unfreeze schedule) are groups
    of their own, never averaged as if they were seeds (``seed_groups``). A group's label is the
    variant's display name where the preset has no other group of that variant; otherwise the
    name has what tells the group apart added: its runs' name without ``_s<seed>``, or where
    those coincide, the settings in which the variant's groups differ. ConfigError for two runs
    of one group with the same seed: the same training twice, not two seeds.
    """
    runs = list(runs)
    groups = [
        Group("", variant, preset, settings, [runs[i] for i in at], [runs[i].seed for i in at])
        for (variant, preset), settings, at in seed_groups(runs, [(r.variant, r.preset) for r in runs])
    ]
    groups.sort(key=lambda g: (g.preset, _variant_order(g.variant)))
    for g in groups:
        g.label = _group_label(g, groups)
    return groups


def _variant_order(v: str) -> tuple[int, str]:
    order = list(GROUP_LABELS)
    return (order.index(v) if v in order else len(order), v)


def _group_label(group: Group, groups: Sequence[Group]) -> str:
    name = GROUP_LABELS.get(group.variant, group.variant)
    siblings = [g for g in groups if (g.variant, g.preset) == (group.variant, group.preset)]
    if len(siblings) == 1:
        return name
    names = [_run_names(g) for g in siblings]
    if len(set(names)) == len(names):
        return f"{name} ({_run_names(group)})"
    return f"{name} ({settings_apart(group.settings, [g.settings for g in siblings])})"


def _run_names(group: Group) -> str:
    return "/".join(dict.fromkeys(re.sub(rf"_s{seed}$", "", r.name) for r, seed in zip(group.runs, group.seeds)))


def settings_apart(settings: dict, siblings: Sequence[dict]) -> str:
    """What tells groups of one name apart: ``settings``' "key=value" pairs, comma-separated,
    for the keys in which the ``siblings`` (those groups' settings, its own included) differ."""
    return ", ".join(f"{k}={settings[k]}" for k in settings if len({repr(s[k]) for s in siblings}) > 1)


def variant_alone(a: Group, b: Group, compare_across: Iterable[str] = ()) -> bool:
    """Whether groups ``a`` and ``b`` were trained with the same settings apart from the variant:
    every setting equal, except the model keys either variant sets, which must hold each
    variant's own value (an OELM-Freeze whose freezing an override changed is not OELM-Freeze),
    and the settings named in ``compare_across`` (dotted keys, e.g. TUNED_SETTINGS for groups
    each at its own tuned learning rate and dropout), which may differ. ConfigError for a key
    of ``compare_across`` that is no setting: a misspelt one would silently compare nothing."""
    across = set(compare_across)
    unknown = sorted(across - set(a.settings))
    if unknown:
        raise ConfigError(
            f"compare_across names {', '.join(unknown)}, which are no trained settings; "
            f"pass dotted keys such as {', '.join(TUNED_SETTINGS)}"
        )
    if a.preset != b.preset:
        return False
    keys = {f"model.{k}" for g in (a, b) for k in variant_overrides(g.variant)}
    for g in (a, b):
        own = _variant_model(g.preset, g.variant, variant_definition(g.preset, g.variant))
        if any(g.settings[k] != own[k] for k in keys):
            return False
    return all(a.settings[k] == b.settings[k] for k in a.settings if k not in keys | across)


def variant_definition(preset: str, variant: str) -> str:
    """The preset's values and the variant's registered overrides, what model_config(preset,
    variant) builds from, as text for caches' keys: a variant registered again
    (config.register_variant) or a preset changed at runtime is then built anew, not read stale."""
    return repr((PRESETS.get(preset), variant_overrides(variant)))


@functools.lru_cache(maxsize=None)
def _variant_model(preset: str, variant: str, definition: str) -> MappingProxyType:
    """{"model.<key>": value} of the preset's variant as model_config builds it, read-only and
    built once per ``definition`` (variant_definition; only in the cache's key): variant_alone
    checks every pair of groups it is given against it."""
    model = dataclasses.asdict(model_config(preset, variant))
    return MappingProxyType({f"model.{k}": v for k, v in model.items()})


# The two warnings a table of groups gives (the results table here, the ablation table of
# oelm_core.analysis.ablations): a mean over fewer seeds than the group has, and settings taken on trust.


def evaluated_seeds(label: str, names: list[str], values: list) -> int:
    """How many seeds of one group have a validation figure (``values``, None where a run ended
    before its first evaluation); warns naming the others, which the group's means leave out."""
    missing = [name for name, value in zip(names, values) if value is None]
    if missing:
        warnings.warn(
            f"{label}: {', '.join(missing)} ended before its first evaluation; "
            f"the validation figures average the other seeds",
            stacklevel=3,
        )
    return len(names) - len(missing)


def assumed_settings(label: str, runs: Sequence[Run]) -> None:
    """Warns naming the runs of one group of seeds that have no config.yaml (Run.config empty):
    seed_groups took them for runs of their variant's default settings, so the group's means
    are that setting's only if they trained it."""
    assumed = [str(run.path) for run in runs if not run.config]
    if assumed:
        warnings.warn(
            f"{label}: {', '.join(assumed)} without config.yaml, averaged as seeds of its variant's "
            f"default settings; if one trained other settings, restore its config.yaml or leave it "
            f"out of the runs read",
            stacklevel=3,
        )
