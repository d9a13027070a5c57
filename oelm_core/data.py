"""TinyStories as flat GPT-2 token files (oelm_core.batches cuts the training and validation batches).

`prepare` reads the stories (from the Hugging Face hub or a local folder), tokenises each one with
the GPT-2 BPE followed by an end-of-text token, and writes one flat uint16 stream per split:

    out_dir/train.bin   uint16[train_tokens]   story_0 EOT story_1 EOT ...
    out_dir/val.bin     uint16[val_tokens]
    out_dir/meta.json   counts, bytes (for bits per byte), the content hash that skips re-runs
                        and the text hash of the stories, whatever their source
    out_dir/.prepare.lock   held while preparing, so that two processes do not write at once

CLI: python -m oelm_core.data --source ../shared/data/tinystories --out-dir data_cache/tinystories
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import re
import reprlib
import sys
import textwrap
import time
from dataclasses import fields
from datetime import datetime, timezone
from itertools import islice
from multiprocessing import Pool
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from oelm_core.config import ConfigError, DataConfig, ModelConfig
from oelm_core.files import DiskFull, atomic_write, exclusive_lock, temporary_files, write_temporary

log = logging.getLogger(__name__)

TOKENIZER = "gpt2"
VOCAB_SIZE = ModelConfig.vocab_size  # the GPT-2 BPE's ids (the model's default vocabulary)
EOT = 50256  # GPT-2's <|endoftext|>: appended after every story
EOT_TEXT = "<|endoftext|>"  # the same separator as it appears in TinyStories .txt files
HUB_NAME = DataConfig.source  # TinyStories on the Hugging Face hub, the default source
# Bump when the token layout changes so that existing caches no longer match and get rebuilt.
FORMAT_VERSION = 1

# Output split name -> folder (or DatasetDict key) names accepted for it, in order of preference.
SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid")}
HUB_SPLITS = {"train": "train", "val": "validation"}
FILE_TYPES = (".txt", ".jsonl", ".parquet")

# Below this many stories a process pool costs more (start-up, pickling) than it saves.
_PARALLEL_MIN_STORIES = 2000
_CHUNK_STORIES = 256  # stories per task sent to a worker process

_INSTALL_HINT = 'install the optional data dependencies: pip install "oelm-core[data]"'
_LOCAL_HINT = (
    "set data.source (or the environment variable OELM_DATA) to a local folder with "
    "train/ and validation/ story files, e.g. ../shared/data/tinystories"
)


# --------------------------------------------------------------------------------------------
# Tokeniser
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def get_tokenizer():
    """The tiktoken GPT-2 encoding (loaded once per process). ConfigError, on one line, when its
    BPE files are neither cached in TIKTOKEN_CACHE_DIR nor downloadable (offline)."""
    import tiktoken

    try:
        return tiktoken.get_encoding(TOKENIZER)
    except Exception as e:  # offline without a cache: tiktoken fails while downloading
        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        missing = f"TIKTOKEN_CACHE_DIR={cache} does not hold them" if cache else "TIKTOKEN_CACHE_DIR is not set"
        reason = textwrap.shorten(f"{type(e).__name__}: {e}", 200)
        # from None: the CLIs print this line, not the 80 lines of the failed download.
        raise ConfigError(
            f"tiktoken could not load the {TOKENIZER!r} BPE files: {missing} and downloading them "
            f"failed ({reason}); set TIKTOKEN_CACHE_DIR to a folder holding the GPT-2 BPE files "
            f"(see the README), e.g. TIKTOKEN_CACHE_DIR=../shared/data/tokenizer/tiktoken_cache"
        ) from None


def encode_prompt(text: str) -> list[int]:
    """The ids of a prompt someone typed (the demo's, ``generate``'s): GPT-2's BPE, where the text
    <|endoftext|> is the end-of-text token (id 50256), as GPT-2's tokenizer reads it, and the
    transformers export's: whoever types it means the break between stories the models learned.
    Story files are tokenised with ``encode_ordinary`` instead (``_encode_chunk``): there the
    separator is read by ``split_stories`` and a story's own text stays text."""
    return get_tokenizer().encode(text, allowed_special={EOT_TEXT})


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, int, int]:
    """Stories -> (their ids, each story followed by EOT, as one uint16 array; UTF-8 bytes; count)."""
    enc = get_tokenizer()
    ids: list[int] = []
    for text in texts:
        # encode_ordinary: a story that happens to contain "<|endoftext|>" stays plain text.
        ids.extend(enc.encode_ordinary(text))
        ids.append(EOT)
    return np.asarray(ids, dtype=np.uint16), sum(len(t.encode("utf-8")) for t in texts), len(texts)


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def _num_procs(num_proc: int, n_stories: int | None) -> int:
    if n_stories is not None and n_stories < _PARALLEL_MIN_STORIES:
        return 1
    return num_proc if num_proc > 0 else min(8, os.cpu_count() or 1)


def _encode_stream(stories: Iterable[str], procs: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """_encode_chunk's results for consecutive chunks of stories, in order, from `procs` processes."""
    chunks = _chunks(stories, _CHUNK_STORIES)
    if procs == 1:
        yield from map(_encode_chunk, chunks)
        return
    with Pool(procs) as pool:
        # imap keeps the order; the parent reads (for the hub: downloads) while the workers encode.
        yield from pool.imap(_encode_chunk, chunks)


# --------------------------------------------------------------------------------------------
# Sources: the hub or a local folder, each giving per split a re-iterable sequence of stories
# --------------------------------------------------------------------------------------------


def split_stories(text: str) -> list[str]:
    """The stories of a TinyStories .txt file, stripped, empty ones dropped.

    Stories are separated by <|endoftext|>, with or without newlines around it. A text without a
    separator (the shared validation file) is one stream: a single "story".
    """
    return [s for s in (part.strip() for part in text.split(EOT_TEXT)) if s]


def _clean(texts: Iterable[str | None], cap: int) -> Iterator[str]:
    """Stripped, non-empty stories; at most `cap` of them (0: all)."""
    n = 0
    for text in texts:
        text = (text or "").strip()
        if text:
            yield text
            n += 1
            if n == cap:
                return


def _field_of(row: dict, text_field: str, where: str) -> str | None:
    try:
        return _story_text(row[text_field], text_field, where)
    except (KeyError, TypeError):
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(
            f"{where} has no field {text_field!r} (it has {keys}); set data.text_field "
            f"to the one that holds the story text"
        ) from None


def _story_text(value, text_field: str, where: str) -> str | None:
    """``value`` when it is a story's text (or missing: None); else the field is not the text."""
    if value is None or isinstance(value, str):
        return value
    raise ConfigError(
        f"{where}: field {text_field!r} holds {type(value).__name__} {reprlib.repr(value)}, "
        f"not a story's text; set data.text_field to the field that holds the text"
    )


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(f"loading this source needs the `datasets` package: {_INSTALL_HINT}") from e
    return datasets


_JSONL_EXAMPLE = '{"text": "Once upon a time..."}'


def _read_file(path: Path, text_field: str) -> Iterator[str]:
    """Raw story texts of one .txt, .jsonl or .parquet file. ConfigError naming the file (and
    line) for a file that is not UTF-8 text, a line that is not JSON, or a damaged parquet."""
    if path.suffix == ".txt":
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = raw.count(b"\n", 0, e.start) + 1
            raise ConfigError(f"{path}:{lineno}: {_not_utf8(e)}") from None
        yield from split_stories(text)
    elif path.suffix == ".jsonl":
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{path}:{lineno}: {_not_utf8(e)}") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    problem = f"{e.msg.removesuffix(' at')} at column {e.colno}"
                    raise ConfigError(
                        f"{path}:{lineno}: not a JSON object ({problem}); a .jsonl file "
                        f"holds one JSON object per line, e.g. {_JSONL_EXAMPLE}"
                    ) from None
                yield _field_of(row, text_field, f"{path}:{lineno}")
    else:  # .parquet
        yield from _read_parquet(path, text_field)


def _not_utf8(e: UnicodeDecodeError) -> str:
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x}); save the story files as UTF-8 text"


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"reading {path} needs `pyarrow`: {_INSTALL_HINT}") from e
    try:
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise ConfigError(
                f"{path} has no column {text_field!r} (it has {pf.schema_arrow.names}); "
                f"set data.text_field to the one that holds the story text"
            )
        for batch in pf.iter_batches(columns=[text_field]):
            for value in batch.column(0).to_pylist():
                yield _story_text(value, text_field, str(path))
    except pyarrow.ArrowException as e:
        raise ConfigError(
            f"{path} is not a readable parquet file ({textwrap.shorten(str(e), 200)}); "
            f"replace it with a readable one (e.g. written by pyarrow.parquet.write_table) "
            f"or remove it"
        ) from None


def _rows(rows: Iterable[dict], text_field: str, where: str) -> Iterator[str]:
    for row in rows:
        yield _field_of(row, text_field, where)


def _file_stories(files: list[Path], text_field: str, cap: int) -> Iterator[str]:
    return _clean((text for path in files for text in _read_file(path, text_field)), cap)


def _dataset_stories(ds, text_field: str, cap: int, where: str) -> Iterator[str]:
    return _clean(_rows(ds, text_field, where), cap)


def _folder_splits(root: Path, cfg: DataConfig) -> dict[str, Callable[[], Iterator[str]]]:
    """Split -> function returning a fresh pass over its stories, for a local folder."""
    if not root.is_dir():
        raise ConfigError(
            f"data folder {root} does not exist; {_LOCAL_HINT}, or to {HUB_NAME!r} to download TinyStories from the hub"
        )
    caps = {"train": cfg.max_train_stories, "val": cfg.max_val_stories}

    if (root / "dataset_dict.json").is_file():  # written by DatasetDict.save_to_disk
        dd = _import_datasets().load_from_disk(str(root))
        splits = {}
        for split, names in SPLIT_NAMES.items():
            key = next((n for n in names if n in dd), None)
            if key is None:
                raise ConfigError(
                    f"the saved dataset {root} has splits {sorted(dd)}, but no "
                    f"{' / '.join(names)}; save a DatasetDict with train and validation"
                )
            splits[split] = functools.partial(_dataset_stories, dd[key], cfg.text_field, caps[split], f"{root} [{key}]")
        return splits

    splits = {}
    for split, names in SPLIT_NAMES.items():
        folder = next((root / n for n in names if (root / n).is_dir()), None)
        if folder is None:
            raise ConfigError(
                f"data folder {root} has no {'/ or '.join(names)}/ folder; it needs "
                f"train/ and validation/ holding {', '.join(FILE_TYPES)} story files"
            )
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in FILE_TYPES)
        if not files:
            raise ConfigError(
                f"{folder} holds no story files; put {', '.join(FILE_TYPES)} files "
                f"there (.txt: stories separated by {EOT_TEXT})"
            )
        splits[split] = functools.partial(_file_stories, files, cfg.text_field, caps[split])
    return splits


def _hub_stories(name: str, split: str, cap: int, text_field: str) -> Iterator[str]:
    """Stories of one hub split; streams only the first `cap` when cap > 0. Whether the hub
    answers is asked here, on the call, before any worker process starts: offline, datasets
    would retry for half a minute before failing (an offline flag makes it read its own cache
    instead, without the network)."""
    from oelm_core.offline import OFFLINE_HINT, hub_unreachable, offline_flag

    # "owner/name" may have been meant as a relative path: say that no such folder exists.
    folder = "" if name == HUB_NAME else f"As a local folder, {Path(name).resolve()} does not exist. "
    unreachable = None if offline_flag() else hub_unreachable()
    if unreachable:
        raise ConfigError(
            f"could not load {name!r} ({split}) from the Hugging Face hub ({unreachable}). "
            f"{folder}Offline? {_LOCAL_HINT}; {OFFLINE_HINT}"
        )
    datasets = _import_datasets()

    def stories() -> Iterator[str]:
        try:
            ds = datasets.load_dataset(name, split=split, streaming=cap > 0)
            yield from _clean(_rows(ds, text_field, f"{name} [{split}]"), cap)
        except ConfigError:
            raise
        except Exception as e:  # no network, unknown name, hub outage: all fixed the same way
            raise ConfigError(
                f"could not load {name!r} ({split}) from the Hugging Face hub "
                f"({type(e).__name__}: {e}). {folder}Offline? {_LOCAL_HINT}; {OFFLINE_HINT}"
            ) from e

    return stories()


def real_source(source: str) -> str:
    """What a run whose data.source is ``source`` reads: $OELM_DATA when set, else ``source``; a
    local folder as its absolute path, a hub dataset id as it is. config.yaml, params.yaml and
    summary.json record this, not the parameter file's hub id that OELM_DATA replaced."""
    chosen = os.environ.get("OELM_DATA") or source
    return chosen if _is_hub(chosen) else str(Path(chosen).expanduser().resolve())


def with_real_source(params: dict) -> dict:
    """A parameter mapping with its data.source as ``real_source`` gives it (a run's params.yaml)."""
    data = dict(params.get("data") or {})
    return {**params, "data": {**data, "source": real_source(data.get("source", DataConfig.source))}}


def resolve_source(cfg: DataConfig) -> str:
    """The source actually used: $OELM_DATA when set, else cfg.source."""
    env = os.environ.get("OELM_DATA")
    if not env:
        return cfg.source
    if cfg.source not in (env, DataConfig.source):
        _say_overridden(cfg.source, env)
    return env


@functools.lru_cache(maxsize=None)
def _say_overridden(source: str, env: str) -> None:
    """Once per process and pair: a study prepares each run's data more than once, and an
    explicit data.source that is silently not read looks like a bug in the parameter file."""
    log.warning(
        "data.source %s is overridden by the environment variable OELM_DATA=%s; unset OELM_DATA to read %s",
        source,
        env,
        source,
    )


def _is_hub(source: str) -> bool:
    """Whether ``source`` is a hub dataset id ("owner/name") rather than a local folder."""
    if Path(source).expanduser().exists():
        return False
    if source == HUB_NAME:
        return True
    # Written as a path (./, ../, ~, /), or inside a folder that exists: a local folder that is
    # missing. Sent to the hub it would cost half a minute of retries offline and an error that
    # never says the folder is missing.
    if source.startswith(("./", "../", "~", "/")) or Path(source.split("/", 1)[0]).is_dir():
        return False
    return re.fullmatch(r"[\w.-]+/[\w.-]+", source) is not None


# --------------------------------------------------------------------------------------------
# prepare / load_meta
# --------------------------------------------------------------------------------------------


def _hashed(stories: Iterable[str], split: str, h) -> Iterator[str]:
    """``stories`` unchanged, each also fed to the hash ``h`` (after a mark of ``split``)."""
    h.update(_split_mark(split))
    for text in stories:
        _hash_story(h, text.encode("utf-8"))
        yield text


def _split_mark(split: str) -> bytes:
    return f"\0split:{split}\0".encode()


def _hash_story(h, data: bytes) -> None:
    """Feed one story's UTF-8 ``data`` to the hash ``h``."""
    h.update(len(data).to_bytes(8, "little"))  # length prefix: no ambiguous joins
    h.update(data)


def _new_text_hash():
    """The hash that meta.json's text_hash is the digest of, before any story: it starts with
    what the content hash also holds of the token layout (FORMAT_VERSION, TOKENIZER), so that
    token files of another layout never pass for the same stories."""
    return hashlib.sha256(json.dumps({"format": FORMAT_VERSION, "tokenizer": TOKENIZER}, sort_keys=True).encode())


def _write_split(
    stories: Iterable[str], path: Path, procs: int, total: int | None, progress: bool
) -> tuple[Path, dict]:
    """(a temporary beside ``path`` holding the split's tokens, for the caller to rename onto
    ``path``; the split's tokens, stories and bytes, and the file's fingerprint: the sha256 of its
    bytes, hashed as they are written, and its mtime, which the rename keeps (oelm_core.provenance
    trusts the hash while the file keeps that mtime))."""
    counts = {"tokens": 0, "stories": 0, "bytes": 0}
    digest = hashlib.sha256()

    def write(f) -> None:
        with tqdm(total=total, unit="stories", desc=f"tokenising {path.name}", disable=not progress) as bar:
            for ids, n_bytes, n in _encode_stream(stories, procs):
                raw = ids.tobytes()
                f.write(raw)
                digest.update(raw)
                counts["tokens"] += len(ids)
                counts["bytes"] += n_bytes
                counts["stories"] += n
                bar.update(n)

    def need() -> float | None:
        """The file's size at the tokens per story so far, where the stories are counted."""
        if not (total and counts["stories"]):
            return None
        return 2 * counts["tokens"] / counts["stories"] * total

    tmp = write_temporary(path, write, need=need, setting="data.out_dir")
    return tmp, {**counts, "sha256": digest.hexdigest(), "mtime_ns": tmp.stat().st_mtime_ns}


def prepare(cfg: DataConfig, *, force: bool = False, progress: bool = True) -> dict:
    """Tokenise the stories into out_dir/{train,val}.bin and meta.json; return the meta.

    Skipped (the existing meta is returned) when meta.json's content_hash matches the source:
    for a local folder a hash of the story texts, for the hub a hash of (name, column, caps),
    which needs no network. meta.json's text_hash is a hash of the token layout and the story
    texts as tokenised, for either source: the same stories from the hub and from a folder have
    the same one (what a resume compares); data prepared before meta.json held one gets it added
    from its token files. `force=True` rebuilds. Under DDP call it on one rank and wait for it
    on the others.
    A second process preparing the same folder waits for the first (a lock on out_dir/.prepare.lock)
    and then finds it up to date; temporary files of a killed preparation are removed.
    """
    started = time.time()
    cfg.validate()
    source = resolve_source(cfg)
    out = Path(cfg.out_dir)
    key = {
        "format": FORMAT_VERSION,
        "tokenizer": TOKENIZER,
        "max_train_stories": cfg.max_train_stories,
        "max_val_stories": cfg.max_val_stories,
    }
    h = hashlib.sha256()

    if _is_hub(source):
        # Hashing the rows would mean downloading them; the hub dataset is fixed, so its name,
        # column and caps identify the content, and a prepared cache is reused offline.
        h.update(json.dumps({**key, "source": source, "text_field": cfg.text_field}, sort_keys=True).encode())
        resolved = source
        caps = {"train": cfg.max_train_stories, "val": cfg.max_val_stories}
        splits = {
            s: functools.partial(_hub_stories, source, HUB_SPLITS[s], caps[s], cfg.text_field) for s in SPLIT_NAMES
        }
        totals = {s: caps[s] or None for s in SPLIT_NAMES}  # unknown until downloaded
    else:
        root = Path(source).expanduser().resolve()
        resolved = str(root)
        splits = _folder_splits(root, cfg)
        h.update(json.dumps(key, sort_keys=True).encode())
        # A first, cheap pass: hash and count the texts.
        totals = {split: sum(1 for _ in _hashed(stories(), split, h)) for split, stories in splits.items()}
    content_hash = h.hexdigest()

    if not force and (meta := _up_to_date(out, content_hash, resolved)) is not None and meta.get("text_hash"):
        return meta
    get_tokenizer()  # fail here, with the TIKTOKEN_CACHE_DIR hint, before any file is touched
    made = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        with _folder_lock(out) as locked:
            # A process preparing the same folder may have finished it while this one waited.
            if not force and (meta := _up_to_date(out, content_hash, resolved)) is not None:
                return meta if meta.get("text_hash") else _add_text_hash(out, meta)
            level, why = _why_rebuilt(out, content_hash, resolved, force)
            log.log(level, "preparing %s from %s: %s", out, resolved, why)
            _remove_stale_temp_files(out, locked, started)
            return _write_all(out, splits, totals, resolved, content_hash, cfg, progress)
    finally:
        for folder in made:  # a preparation that failed leaves no empty folders behind
            try:
                folder.rmdir()
            except OSError:
                break


def _write_all(
    out: Path, splits: dict, totals: dict, resolved: str, content_hash: str, cfg: DataConfig, progress: bool
) -> dict:
    """Tokenise every split into out/{split}.bin, then write out/meta.json; return the meta.

    Every token file is written to a temporary first. Until all are whole, the folder keeps what
    it held (a failure, a kill or a full disk removes or leaves only temporaries); then the old
    meta.json goes, the token files are renamed into place and the new meta.json is written, so
    that at no moment does a meta.json vouch for token files it does not describe."""
    meta_path = out / "meta.json"
    meta = {"source": resolved, "tokenizer": TOKENIZER, "vocab_size": VOCAB_SIZE, "dtype": "uint16"}
    text_hash = _new_text_hash()
    written: dict[str, Path] = {}
    try:
        for split, stories in splits.items():
            procs = _num_procs(cfg.num_proc, totals[split])
            written[split], counts = _write_split(
                _hashed(stories(), split, text_hash), out / f"{split}.bin", procs, totals[split], progress
            )
            if counts["tokens"] == 0:
                raise ConfigError(
                    f"the {split} split of {resolved} holds no stories; check its files and data.text_field"
                )
            meta.update({f"{split}_{k}": v for k, v in counts.items()})
        meta.update(
            max_train_stories=cfg.max_train_stories,
            max_val_stories=cfg.max_val_stories,
            content_hash=content_hash,
            text_hash=text_hash.hexdigest(),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        new_meta = write_temporary(meta_path, lambda f: json.dump(meta, f, indent=2), mode="w", setting="data.out_dir")
        written["meta"] = new_meta
        meta_path.unlink(missing_ok=True)
        for split in SPLIT_NAMES:
            os.replace(written.pop(split), out / f"{split}.bin")
        os.replace(written.pop("meta"), meta_path)
    finally:
        for tmp in written.values():
            tmp.unlink(missing_ok=True)
    log.info("prepared %s: %d train / %d val tokens", out, meta["train_tokens"], meta["val_tokens"])
    return meta


def _add_text_hash(out: Path, meta: dict) -> dict:
    """``meta`` of data prepared before meta.json held a text hash, with the text hash added
    (and written to out/meta.json); no re-tokenising, nor, for the hub, downloading. The token
    files hold each story's ids and then EOT, which no story's own ids contain (encode_ordinary),
    and the GPT-2 BPE decodes ids back to exactly the bytes they encode: the stories decoded
    between EOTs hash as the texts they were tokenised from."""
    log.info(
        "adding the text hash of the stories to %s/meta.json (prepared before it held one): decoding the token files",
        out,
    )
    enc = get_tokenizer()
    h = _new_text_hash()
    for split in SPLIT_NAMES:
        tokens = np.memmap(out / f"{split}.bin", dtype=np.uint16, mode="r")
        h.update(_split_mark(split))
        start = 0
        for end in np.flatnonzero(tokens == EOT).tolist():
            _hash_story(h, enc.decode_bytes(tokens[start:end].tolist()))
            start = end + 1
    meta = {**meta, "text_hash": h.hexdigest()}
    atomic_write(out / "meta.json", lambda f: json.dump(meta, f, indent=2), mode="w")
    return meta


def _up_to_date(out: Path, content_hash: str, resolved: str) -> dict | None:
    """out's meta when it was prepared from this content and its token files are whole, else None.
    A meta without text_hash (prepared before there was one) is returned as it is, for prepare
    to add it."""
    meta = _read_meta(out / "meta.json")
    if meta is None or meta.get("content_hash") != content_hash or not _bins_match(out, meta):
        return None
    if meta.get("text_hash"):
        log.info(
            "%s is up to date with %s (content hash %s...); skipping (force=True rebuilds)",
            out,
            resolved,
            content_hash[:12],
        )
    return meta


def _why_rebuilt(out: Path, content_hash: str, resolved: str, force: bool) -> tuple[int, str]:
    """(log level, why ``out`` is being prepared): the first time, --force, other stories, or
    token files or a meta.json that were damaged (a warning: something else wrote there)."""
    meta_path = out / "meta.json"
    if force:
        return logging.INFO, "force=True (--force) rebuilds it"
    if not meta_path.exists():
        made = [n for n in ("train.bin", "val.bin") if (out / n).exists()]
        return (
            (
                logging.WARNING,
                f"it has {' and '.join(made)} but no meta.json (removed, or an interrupted "
                f"preparation of an older version)",
            )
            if made
            else (logging.INFO, "it holds no prepared data yet")
        )
    meta = _read_meta(meta_path)
    if meta is None:
        return logging.WARNING, "its meta.json is damaged (empty, not JSON or not a mapping)"
    if meta.get("content_hash") != content_hash:
        before = meta.get("source")
        where = (
            f"it was prepared from {before}, this run reads {resolved}"
            if before != resolved
            else f"the stories of {resolved} changed since it was prepared"
        )
        return logging.INFO, (
            f"{where} (content hash {str(meta.get('content_hash'))[:12]}... recorded, {content_hash[:12]}... now)"
        )
    for split in SPLIT_NAMES:
        path, tokens = out / f"{split}.bin", meta.get(f"{split}_tokens")
        if not isinstance(tokens, int):
            return logging.WARNING, f"its meta.json records no whole {split}_tokens count ({tokens!r})"
        if not path.is_file():
            return logging.WARNING, f"{path.name} is missing"
        if path.stat().st_size != 2 * tokens:
            return logging.WARNING, (
                f"{path.name} holds {path.stat().st_size:,} bytes where meta.json records "
                f"{tokens:,} tokens ({2 * tokens:,} bytes): damaged, or written by "
                f"something else"
            )
    return logging.INFO, "its meta.json has no text hash"  # not reached: _up_to_date accepts it


def _read_meta(path: Path) -> dict | None:
    """The mapping meta.json holds; None where it is missing or damaged (empty, not JSON, not a
    mapping: a foreign or interrupted write), which prepare rebuilds and load_meta refuses."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _bins_match(out: Path, meta: dict) -> bool:
    """Both token files exist with the sizes meta.json records (2 bytes per token)."""
    return all(
        isinstance(meta.get(f"{s}_tokens"), int)
        and (out / f"{s}.bin").is_file()
        and (out / f"{s}.bin").stat().st_size == 2 * meta[f"{s}_tokens"]
        for s in SPLIT_NAMES
    )


def _folder_lock(out: Path) -> ContextManager[bool]:
    """A context manager holding an exclusive lock on out/.prepare.lock while preparing ``out``:
    a second process preparing the same folder waits on entering it. Entering it gives whether
    the lock is held (``exclusive_lock``'s answer: False where the file system has no locks)."""
    return exclusive_lock(
        out / ".prepare.lock", on_wait=lambda: log.info("waiting for another process that is preparing %s", out)
    )


def _remove_stale_temp_files(out: Path, locked: bool, started: float) -> None:
    """Remove what killed writes of prepare's outputs left in ``out`` (atomic_write's temporary
    ``.train.bin.*.tmp`` and the like). Under the lock no other process is writing there. Without
    it only files untouched since this call started (``started``, time.time()) go: a live write
    keeps touching its file, and Windows refuses to delete a file that another process holds open."""
    for name in ("train.bin", "val.bin", "meta.json"):
        for tmp in temporary_files(out, name):
            try:
                if locked or tmp.stat().st_mtime < started:
                    tmp.unlink()
                    log.info("removed %s, left by an interrupted preparation", tmp)
            except OSError:  # removed by another process meanwhile, or open in one
                pass


def rebuild_hint(out_dir: Path) -> str:
    return f"rebuild with `python -m oelm_core.data --source <folder or {HUB_NAME}> --out-dir {out_dir} --force`"


def prepare_hint(out_dir: Path) -> str:
    return (
        f"run `python -m oelm_core.data --source <folder or {HUB_NAME}> --out-dir {out_dir}` "
        f"or set data.source so that training prepares it"
    )


def load_meta(out_dir: str | Path) -> dict:
    """meta.json of a prepared folder, after checking that its token files are there and whole."""
    out = Path(out_dir)
    missing = [n for n in ("meta.json", "train.bin", "val.bin") if not (out / n).is_file()]
    if missing:
        raise ConfigError(f"no prepared data in {out} (missing {', '.join(missing)}); {prepare_hint(out)}")
    meta = _read_meta(out / "meta.json")
    if meta is None:
        raise ConfigError(
            f"{out / 'meta.json'} is damaged (empty, not JSON or not a mapping: an "
            f"interrupted or foreign write); {rebuild_hint(out)}"
        )
    if not _bins_match(out, meta):
        raise ConfigError(
            f"the token files in {out} do not match its meta.json (an interrupted or "
            f"foreign write); {rebuild_hint(out)}"
        )
    return meta


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The CLI: prints meta.json's content; returns the exit code (0 done, 2 unusable source or
    settings, 1 a full disk; the error on stderr, one line)."""
    defaults = DataConfig()
    p = argparse.ArgumentParser(prog="python -m oelm_core.data", description=__doc__.split("\n")[0])
    p.add_argument(
        "--source", default=defaults.source, help=f"{HUB_NAME!r} or a local folder (the env var OELM_DATA overrides it)"
    )
    p.add_argument("--out-dir", default=defaults.out_dir)
    p.add_argument("--max-train-stories", type=int, default=defaults.max_train_stories)
    p.add_argument("--max-val-stories", type=int, default=defaults.max_val_stories)
    p.add_argument("--text-field", default=defaults.text_field)
    p.add_argument("--num-proc", type=int, default=defaults.num_proc)
    p.add_argument("--force", action="store_true", help="rebuild even when the cache is up to date")
    p.add_argument("--no-progress", action="store_true")
    args = vars(p.parse_args(argv))
    force, progress = args.pop("force"), not args.pop("no_progress")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = DataConfig(**{f.name: args[f.name] for f in fields(DataConfig)})
    try:
        meta = prepare(cfg, force=force, progress=progress)
    except (ConfigError, DiskFull) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, DiskFull) else 2  # 1: what a crash on a full disk exited with
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
