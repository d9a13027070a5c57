"""Parameter files: the YAML a run, a plan or a notebook reads, the ``--set key=value`` overrides,
and a run's parameters loaded and saved.

``config`` is the schema these fill; this module turns text into the mappings it checks. YAML is
read with PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
silently); every problem is a ConfigError that names the file, line and fix.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from oelm_core.config import PRESETS, ConfigError, RunConfig, run_config_from_dict, variants
from oelm_core.files import write_text_atomic


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """tree["a"]["b"] = value for dotted "a.b", creating sections that do not exist yet."""
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if node.get(k) is None:  # a new section, or one whose keys are all commented out
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted}: {k} is not a section")
    node[keys[-1]] = value


def apply_overrides(values: dict, overrides: list[str] | dict[str, Any] | None) -> dict:
    """A copy of a nested mapping with ``overrides`` set, in order: ``key.sub=value`` strings
    (what --set takes; values parsed as YAML) or a mapping {dotted key: value}."""
    values = copy.deepcopy(values)
    items = overrides.items() if isinstance(overrides, dict) else map(_parse_override, overrides or [])
    for key, value in items:
        set_dotted(values, key, value)
    return values


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first_line: int, line: int):
        where = f"on line {line}" if line == first_line else f"on lines {first_line} and {line}"
        super().__init__(
            f"the key {key!r} appears twice in one mapping ({where}); YAML would keep "
            f"only the second silently: merge the two into one"
        )


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a key given twice in one mapping: PyYAML keeps the last
    value, so a second ``train:`` section would silently drop the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    continue
        return super().construct_mapping(node, deep=deep)


def _parse_override(item: str) -> tuple[str, Any]:
    """One --set string as (dotted key, value): train.steps=200 -> ("train.steps", 200)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value (e.g. train.steps=200), got {item!r}")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.load(raw, Loader=_UniqueKeyLoader)
    except _DuplicateKey as exc:
        raise ConfigError(f"--set {item!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {item!r}: the value is not valid YAML ({_yaml_problem(exc)}); "
            f"complete it (e.g. train.lr=0.001, model.freeze_qk=[0,1]) or quote "
            f"it to pass a string"
        ) from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: its message spans four, with the text pointed at."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return " ".join(str(exc).split())
    where = f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    start = getattr(exc, "context_mark", None)
    if exc.context and start is not None:
        where += f" ({exc.context} from line {start.line + 1}, column {start.column + 1})"
    return where


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML file holds ({} for an empty file). ConfigError, naming the file, for a
    syntax error (with its line and column), a key given twice in one mapping, a file that is
    not UTF-8 text, or a top level that is not a mapping."""
    path = Path(path)
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        # A tab where YAML wants spaces (an editor's indent) has its own fix.
        hint = (
            "YAML indents with spaces, never tabs: replace the tab with spaces"
            if "'\\t'" in str(getattr(exc, "problem", ""))
            else "an unclosed bracket or quote is the usual cause"
        )
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(exc)}; fix the syntax there ({hint})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a UTF-8 text file; pass a YAML file") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(
            f"{path} must hold a YAML mapping at the top level (key: value lines), got a {type(values).__name__}"
        )
    return values


EXAMPLE_PARAMETER_FILE = "parameters/smoke/oelm_freeze.yaml"


def _check_parameter_file(path: Path, values: dict) -> None:
    """ConfigError where ``values`` (a parameter file with its overrides applied) do not say which
    model they train: without ``preset`` or ``variant`` an empty file trained the Medium-512
    GPT-Base defaults. A plan file (a study, a sweep) is named as one, with the command that runs it."""
    for section in ("experiment", "study", "sweep"):
        if section in values:
            raise ConfigError(
                f"{path} is a plan file (it has the `{section}:` section): run it with "
                f"python -m oelm_core run {path}; a training reads a parameter file of one run, "
                f"e.g. {EXAMPLE_PARAMETER_FILE}"
            )
    model = values.get("model") if isinstance(values.get("model"), dict) else {}
    # Written inside model:, they get RunConfig.model_config's message, which says where they go.
    missing = [key for key in ("preset", "variant") if values.get(key) is None and key not in model]
    if missing:
        raise ConfigError(
            f"{path} does not say which model to train: it has no "
            f"{' or '.join(f'`{key}:`' for key in missing)}; a parameter file holds at least "
            f"`preset:` and `variant:` (top-level keys, or --set preset=... variant=...) with "
            f"optional model, data and train sections (see {EXAMPLE_PARAMETER_FILE}). "
            f"presets: {', '.join(PRESETS)}; variants: {', '.join(variants())}"
        )


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML parameter file, apply overrides, check it all. A file must give ``preset`` and
    ``variant`` (itself or through ``overrides``); without a file (None) every value not
    overridden is RunConfig's default."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"parameter file {path} not found; pass an existing YAML file (see parameters/ for examples)"
            )
        values = apply_overrides(read_yaml(path), overrides or [])
        _check_parameter_file(path, values)
        return run_config_from_dict(values)
    return run_config_from_dict(apply_overrides(values, overrides or []))


def save_run_config(cfg: RunConfig, path: str | Path) -> None:
    write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
