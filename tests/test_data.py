"""oelm_core.data: story splitting, every source format, caching, samplers, errors, metrics."""

import errno
import hashlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import STORIES

from oelm_core import batches, data
from oelm_core.config import ConfigError, DataConfig

SHARED_STORIES = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories"


@pytest.fixture(autouse=True)
def _no_env_source(monkeypatch):
    # CI may point OELM_DATA at a folder; these tests choose their sources themselves.
    monkeypatch.delenv("OELM_DATA", raising=False)


def expected_ids(stories):
    enc = data.get_tokenizer()
    ids = []
    for s in stories:
        ids += enc.encode_ordinary(s.strip()) + [data.EOT]
    return np.array(ids, dtype=np.uint16)


def read_bin(path):
    return np.fromfile(path, dtype=np.uint16)


def cfg_for(source, out, **kw):
    return DataConfig(source=str(source), out_dir=str(out), **kw)


# --- story splitting ----------------------------------------------------------------------


def test_split_stories_separators():
    assert data.split_stories("a<|endoftext|>b") == ["a", "b"]
    assert data.split_stories("a\n<|endoftext|>\nb\n<|endoftext|>\n") == ["a", "b"]
    assert data.split_stories("One day.\n\nThe end.\n\nAnother.\n") == ["One day.\n\nThe end.\n\nAnother."]


def test_known_ids():
    assert data.get_tokenizer().encode_ordinary("Hello world") == [15496, 995]
    assert data.get_tokenizer().n_vocab == data.VOCAB_SIZE == data.EOT + 1


# --- every source format prepares to exactly the direct encoding ---------------------------


def test_txt_folder(story_folder, tmp_path):
    meta = data.prepare(cfg_for(story_folder, tmp_path / "out"), progress=False)
    train, val = read_bin(tmp_path / "out/train.bin"), read_bin(tmp_path / "out/val.bin")
    np.testing.assert_array_equal(train, expected_ids(STORIES * 20))
    np.testing.assert_array_equal(val, expected_ids(STORIES[:3] * 10))
    assert meta["train_stories"] == 120 and meta["val_stories"] == 30
    assert meta["train_tokens"] == len(train) and meta["val_tokens"] == len(val)
    assert meta["train_bytes"] == 20 * sum(len(s.encode()) for s in STORIES)
    assert (train == data.EOT).sum() == 120 and train[-1] == data.EOT
    assert meta["source"] == str(story_folder.resolve())
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16" and meta["tokenizer"] == "gpt2"
    assert data.load_meta(tmp_path / "out") == meta


def test_txt_without_separator_is_one_stream(tmp_path):
    root = tmp_path / "src"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()  # "val/" is accepted for validation/
    (root / "train" / "b.txt").write_text("Hello world<|endoftext|>")
    (root / "train" / "a.txt").write_text("Hello<|endoftext|>")  # sorted: a.txt comes first
    (root / "val" / "v.txt").write_text("One story.\n\nAnother story.\n")
    data.prepare(cfg_for(root, tmp_path / "out"), progress=False)
    assert read_bin(tmp_path / "out/train.bin").tolist() == [15496, 50256, 15496, 995, 50256]
    np.testing.assert_array_equal(read_bin(tmp_path / "out/val.bin"), expected_ids(["One story.\n\nAnother story."]))


def test_jsonl(tmp_path):
    root = tmp_path / "src"
    for split, stories in (("train", ["Hello world", *STORIES]), ("validation", STORIES[:2])):
        (root / split).mkdir(parents=True)
        rows = [json.dumps({"story": s, "id": i}) for i, s in enumerate(stories)]
        (root / split / "part.jsonl").write_text("\n".join(rows) + "\n\n")
    meta = data.prepare(cfg_for(root, tmp_path / "out", text_field="story", max_val_stories=1), progress=False)
    train = read_bin(tmp_path / "out/train.bin")
    assert train[:3].tolist() == [15496, 995, 50256]
    np.testing.assert_array_equal(train, expected_ids(["Hello world", *STORIES]))
    np.testing.assert_array_equal(read_bin(tmp_path / "out/val.bin"), expected_ids(STORIES[:1]))
    assert meta["val_stories"] == 1


def test_jsonl_wrong_field_names_the_fix(tmp_path):
    root = tmp_path / "src"
    for split in ("train", "validation"):
        (root / split).mkdir(parents=True)
        (root / split / "p.jsonl").write_text(json.dumps({"story": "Hi"}) + "\n")
    with pytest.raises(ConfigError, match=r"no field 'text'.*\['story'\].*data.text_field"):
        data.prepare(cfg_for(root, tmp_path / "out"), progress=False)


def test_a_field_that_is_not_text_names_the_file_and_line(tmp_path):
    root = tmp_path / "src"
    for split in ("train", "validation"):
        (root / split).mkdir(parents=True)
        (root / split / "p.jsonl").write_text(json.dumps({"text": "A story."}) + "\n" + json.dumps({"text": 42}) + "\n")
    with pytest.raises(
        ConfigError, match=r"p\.jsonl:2: field 'text' holds int 42, not a story's text; set data\.text_field"
    ):
        data.prepare(cfg_for(root, tmp_path / "out"), progress=False)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root = tmp_path / "src"
    for split, stories in (("train", STORIES), ("valid", STORIES[3:])):
        (root / split).mkdir(parents=True)
        pq.write_table(pa.table({"text": stories[:3]}), root / split / "0.parquet")
        pq.write_table(pa.table({"text": stories[3:]}), root / split / "1.parquet")
    data.prepare(cfg_for(root, tmp_path / "out", max_train_stories=4), progress=False)
    np.testing.assert_array_equal(read_bin(tmp_path / "out/train.bin"), expected_ids(STORIES[:4]))
    np.testing.assert_array_equal(read_bin(tmp_path / "out/val.bin"), expected_ids(STORIES[3:]))


def test_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["Hello world", *STORIES, "  "]}),
            "validation": datasets.Dataset.from_dict({"text": STORIES[:2]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "saved"))
    meta = data.prepare(cfg_for(tmp_path / "saved", tmp_path / "out"), progress=False)
    np.testing.assert_array_equal(
        read_bin(tmp_path / "out/train.bin"), expected_ids(["Hello world", *STORIES])
    )  # blank row dropped
    np.testing.assert_array_equal(read_bin(tmp_path / "out/val.bin"), expected_ids(STORIES[:2]))
    assert meta["train_stories"] == 7


def test_parallel_tokenising_matches_serial(tmp_path):
    root = tmp_path / "src"
    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    many = [f"Story {i}: {STORIES[i % len(STORIES)]}" for i in range(2500)]  # above the 1-process limit
    (root / "train" / "t.txt").write_text("<|endoftext|>".join(many))
    (root / "validation" / "v.txt").write_text("Hello world")
    meta = data.prepare(cfg_for(root, tmp_path / "out", num_proc=2), progress=False)
    np.testing.assert_array_equal(read_bin(tmp_path / "out/train.bin"), expected_ids(many))
    assert meta["train_stories"] == 2500


def test_env_overrides_source(story_folder, tmp_path, monkeypatch, caplog):
    """The override of an explicit data.source is said once, however often the data is prepared;
    the default source, which OELM_DATA exists to replace offline, goes unmentioned."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    explicit = cfg_for(tmp_path / "not-there", tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="oelm_core.data"):
        meta = data.prepare(explicit, progress=False)
        data.prepare(explicit, progress=False)
    assert meta["source"] == str(story_folder.resolve())
    assert [r.getMessage() for r in caplog.records] == [
        f"data.source {tmp_path / 'not-there'} is overridden by the environment variable "
        f"OELM_DATA={story_folder}; unset OELM_DATA to read {tmp_path / 'not-there'}"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oelm_core.data"):
        data.prepare(cfg_for(data.HUB_NAME, tmp_path / "out"), progress=False)
    assert caplog.records == []


# --- caching ------------------------------------------------------------------------------


def test_prepare_skips_when_unchanged_and_redoes_on_change(story_folder, tmp_path):
    cfg = cfg_for(story_folder, tmp_path / "out")
    first = data.prepare(cfg, progress=False)
    mtimes = {n: os.stat(tmp_path / "out" / n).st_mtime_ns for n in ("train.bin", "val.bin", "meta.json")}
    time.sleep(0.01)
    assert data.prepare(cfg, progress=False) == first
    assert {n: os.stat(tmp_path / "out" / n).st_mtime_ns for n in mtimes} == mtimes

    part = story_folder / "train" / "part.txt"
    part.write_text(part.read_text().replace("Tom", "Tim", 1))
    second = data.prepare(cfg, progress=False)
    assert second["content_hash"] != first["content_hash"]
    assert "Tim" in data.get_tokenizer().decode(read_bin(tmp_path / "out/train.bin")[:30].tolist())

    forced = data.prepare(cfg, force=True, progress=False)
    assert forced["content_hash"] == second["content_hash"]
    assert os.stat(tmp_path / "out/meta.json").st_mtime_ns != mtimes["meta.json"]
    # A different cap is different content.
    assert (
        data.prepare(cfg_for(story_folder, tmp_path / "out", max_train_stories=5), progress=False)["train_stories"] == 5
    )


def test_cli(story_folder, tmp_path, capsys):
    assert (
        data.main(
            [
                "--source",
                str(story_folder),
                "--out-dir",
                str(tmp_path / "out"),
                "--max-train-stories",
                "7",
                "--no-progress",
            ]
        )
        == 0
    )
    meta = json.loads(capsys.readouterr().out)
    assert meta["train_stories"] == 7 and meta["vocab_size"] == 50257
    assert meta == json.loads((tmp_path / "out" / "meta.json").read_text())


def test_cli_error_is_one_line_and_exit_code_2(tmp_path):
    """A missing source ended in a traceback (exit 1); train and sweep exit 2 with `error: ...`."""
    import subprocess
    import sys

    missing = tmp_path / "nonexistent" / "x"
    proc = subprocess.run(
        [sys.executable, "-m", "oelm_core.data", "--source", str(missing), "--out-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: data folder {missing} does not exist; set data.source")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# --- samplers -----------------------------------------------------------------------------


@pytest.fixture
def bin_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)  # token value == position: easy to check shifts
    return path


def test_sampler_shapes_and_shift(bin_file):
    s = batches.TokenSampler(bin_file, block_size=16, batch_size=4, seed=0)
    x, y = s.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # token value == position
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert s.tokens_per_batch == 64


def test_sampler_reproducible_ranks_and_resume(bin_file):
    a = batches.TokenSampler(bin_file, 16, 4, seed=1)
    b = batches.TokenSampler(bin_file, 16, 4, seed=1)
    drawn = [a.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(u, b.next_batch()[0]) for u in drawn)
    assert not torch.equal(drawn[0], drawn[1])

    r1 = batches.TokenSampler(bin_file, 16, 4, seed=1, rank=1, world_size=2)
    assert not torch.equal(drawn[0], r1.next_batch()[0])
    assert not torch.equal(drawn[0], batches.TokenSampler(bin_file, 16, 4, seed=2).next_batch()[0])

    state = a.state_dict()
    assert state == {"batches_drawn": 3}
    expected = a.next_batch()
    resumed = batches.TokenSampler(bin_file, 16, 4, seed=1)
    resumed.load_state_dict(state)
    got = resumed.next_batch()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_sampler_to_device(bin_file):
    x, y = batches.TokenSampler(bin_file, 8, 2, seed=0).next_batch(device="cpu")
    assert x.device.type == "cpu" and x.shape == (2, 8)


def test_eval_batches(bin_file):
    first = batches.eval_batches(bin_file, block_size=16, batch_size=4, n_batches=3)
    again = batches.eval_batches(bin_file, block_size=16, batch_size=4, n_batches=3)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, again):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(y1, x1 + 1)
    starts = torch.cat([x[:, 0] for x, _ in first])
    assert len(set(starts.tolist())) == 12  # distinct windows

    # 1000 tokens hold (1000 - 1) // 100 = 9 windows of 101 tokens: all 9, in batches of 4.
    small = batches.eval_batches(bin_file, block_size=100, batch_size=4, n_batches=10)
    assert [len(x) for x, _ in small] == [4, 4, 1]
    assert torch.cat([x[:, 0] for x, _ in small]).tolist() == list(range(0, 900, 100))


# --- errors name the fix ------------------------------------------------------------------


def test_missing_data_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist.*OELM_DATA.*train/ and validation/"):
        data.prepare(cfg_for(tmp_path / "nowhere", tmp_path / "out"), progress=False)


def test_missing_validation_split(story_folder, tmp_path):
    for f in (story_folder / "validation").iterdir():
        f.unlink()
    (story_folder / "validation").rmdir()
    with pytest.raises(ConfigError, match=r"no validation/ or val/ or valid/ folder.*needs train/ and validation/"):
        data.prepare(cfg_for(story_folder, tmp_path / "out"), progress=False)


def test_file_too_short(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(ConfigError, match=r"10 tokens.*block_size \+ 1 = 11.*smaller model.block_size"):
        batches.TokenSampler(path, block_size=10, batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="smaller model.block_size"):
        batches.eval_batches(path, block_size=10, batch_size=2, n_batches=1)
    assert len(batches.eval_batches(path, block_size=9, batch_size=2, n_batches=5)) == 1


def test_an_empty_or_odd_sized_token_file_names_the_fix(tmp_path):
    """np.memmap said "cannot mmap an empty file" or "not a multiple of the data-type size"."""
    path = tmp_path / "train.bin"
    for size in (0, 21):
        path.write_bytes(b"\1" * size)
        message = (
            rf"train\.bin holds {size} bytes, not a whole number of 2-byte \(uint16\) tokens \(an "
            rf"interrupted or foreign write\); rebuild with `python -m oelm_core\.data .* --force`"
        )
        with pytest.raises(ConfigError, match=message):
            batches.TokenSampler(path, block_size=4, batch_size=2, seed=0)
        with pytest.raises(ConfigError, match=message):
            batches.eval_batches(path, block_size=4, batch_size=2, n_batches=1)


def test_load_meta_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"missing meta.json, train.bin, val.bin.*python -m oelm_core.data"):
        data.load_meta(tmp_path)


def test_tokenizer_offline_is_one_config_error_line(story_folder, tmp_path, monkeypatch, capsys):
    """Offline without the BPE files tiktoken's download failed as a RuntimeError chained to ~80
    lines of socket and urllib3 tracebacks; it is one ConfigError line naming the fix."""
    import tiktoken.load
    import tiktoken.registry

    def offline(url):
        raise ConnectionError(
            f"HTTPSConnectionPool(host='openaipublic.blob.core.windows.net'): Max "
            f"retries exceeded with url: {url}\n(Caused by NameResolutionError)"
        )

    empty = tmp_path / "empty_cache"
    empty.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(empty))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget the encoding loaded by other tests
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    data.get_tokenizer.cache_clear()
    try:
        with pytest.raises(ConfigError) as exc:
            data.get_tokenizer()
        message = str(exc.value)
        assert message.startswith(
            f"tiktoken could not load the 'gpt2' BPE files: TIKTOKEN_CACHE_DIR={empty} "
            f"does not hold them and downloading them failed (ConnectionError: "
            f"HTTPSConnectionPool(host='openaipublic.blob.core.windows.net')"
        )
        assert "set TIKTOKEN_CACHE_DIR to a folder holding the GPT-2 BPE files (see the README)" in message
        assert "\n" not in message and exc.value.__suppress_context__ and exc.value.__cause__ is None
        monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
        data.get_tokenizer.cache_clear()
        with pytest.raises(ConfigError, match=r"BPE files: TIKTOKEN_CACHE_DIR is not set and downloading"):
            data.get_tokenizer()
        # The CLI prints it as its one error line, exit code 2, before writing anything.
        data.get_tokenizer.cache_clear()
        assert data.main(["--source", str(story_folder), "--out-dir", str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: tiktoken could not load the 'gpt2' BPE files") and err.count("\n") == 1
        assert not (tmp_path / "out" / "train.bin").exists()
    finally:
        data.get_tokenizer.cache_clear()


# --- damaged inputs name the file and the fix -----------------------------------------------


def story_files(root, name, train_bytes, val_text="A story."):
    """A source folder whose train/ holds ``name`` with ``train_bytes``."""
    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    (root / "train" / name).write_bytes(train_bytes)
    (root / "validation" / "v.txt").write_text(val_text)
    return root


def test_a_story_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    root = story_files(tmp_path / "txt", "part.txt", b"One story.\n<|endoftext|>\nA caf\xe9 story.\n")
    with pytest.raises(
        ConfigError,
        match=r"^.*train/part\.txt:3: not UTF-8 text \(byte 0xe9\); save the story "
        r"files as UTF-8 text$",
    ):
        data.prepare(cfg_for(root, tmp_path / "out"), progress=False)
    rows = b'{"text": "One story."}\n{"text": "A caf\xe9 story."}\n'
    root = story_files(tmp_path / "jsonl", "p.jsonl", rows)
    with pytest.raises(ConfigError, match=r"train/p\.jsonl:2: not UTF-8 text \(byte 0xe9\)"):
        data.prepare(cfg_for(root, tmp_path / "out"), progress=False)


def test_a_jsonl_line_that_is_not_json_names_the_file_and_line(tmp_path):
    rows = b'{"text": "One story."}\n\n{"text": "Cut short\n{"text": "Another."}\n'
    root = story_files(tmp_path / "src", "p.jsonl", rows)
    with pytest.raises(
        ConfigError,
        match=r"train/p\.jsonl:3: not a JSON object \(Invalid control character at "
        r"column 20\); a \.jsonl file holds one JSON object per line, e\.g\. "
        r"\{\"text\": \"Once upon a time\.\.\.\"\}$",
    ):
        data.prepare(cfg_for(root, tmp_path / "out"), progress=False)


def test_a_damaged_parquet_file_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["One story.", "Another story."]}), good)
    for label, damaged in (("garbage", b"PAR1 not a parquet file PAR1"), ("cut", good.read_bytes()[:-20])):
        root = story_files(tmp_path / label, "0.parquet", damaged)
        with pytest.raises(
            ConfigError,
            match=r"train/0\.parquet is not a readable parquet file \(.+\); replace it "
            r"with a readable one .*or remove it$",
        ):
            data.prepare(cfg_for(root, tmp_path / "out"), progress=False)


def test_a_damaged_meta_json_is_rebuilt_by_prepare_and_refused_by_load_meta(story_folder, tmp_path):
    """An empty meta.json (JSONDecodeError) or one holding a list (AttributeError) blocked
    preparation; prepare now treats it as absent, load_meta names it and the fix."""
    out = tmp_path / "out"
    cfg = cfg_for(story_folder, out)
    first = data.prepare(cfg, progress=False)
    for damaged in ("", "[1, 2]", '{"train_tokens": null, "val_tokens": "12"}'):
        (out / "meta.json").write_text(damaged)
        if damaged.startswith("{"):
            match = r"the token files in .*out do not match its meta\.json"
        else:
            match = r"out/meta\.json is damaged \(empty, not JSON or not a mapping"
        with pytest.raises(
            ConfigError,
            match=match + r".*rebuild with `python -m oelm_core\.data --source "
            r"<folder or roneneldan/TinyStories> --out-dir .*out --force`",
        ):
            data.load_meta(out)
        meta = data.prepare(cfg, progress=False)
        when = ("created", "train_mtime_ns", "val_mtime_ns")  # the rebuild's own times
        assert {k: v for k, v in meta.items() if k not in when} == {k: v for k, v in first.items() if k not in when}
        assert data.load_meta(out) == meta


def test_prepare_removes_temp_files_of_killed_writes(story_folder, tmp_path):
    """atomic_write's .train.bin.*.tmp of a killed preparation stayed forever (a full-size copy
    of the token file each time)."""
    out = tmp_path / "out"
    out.mkdir()
    left = [out / ".train.bin.k1ll3d.tmp", out / ".val.bin.abc123.tmp", out / ".meta.json.x.tmp"]
    for path in left:
        path.write_bytes(b"\0" * 1000)
    other = out / "notes.tmp"
    other.write_text("not ours")
    data.prepare(cfg_for(story_folder, out), progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "notes.tmp", "train.bin", "val.bin"]
    np.testing.assert_array_equal(read_bin(out / "train.bin"), expected_ids(STORIES * 20))


def test_without_locks_only_temp_files_older_than_the_call_are_removed(story_folder, tmp_path, monkeypatch):
    """Where the file system has no locks (flock: ENOLCK) no lock says whether another process is
    writing: a temporary file touched since this call started may be a live write and stays."""
    fcntl = pytest.importorskip("fcntl")

    def refuses(f, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuses)
    out = tmp_path / "out"
    out.mkdir()
    stale, live = out / ".train.bin.stale.tmp", out / ".train.bin.live.tmp"
    stale.write_bytes(b"\0" * 10)
    live.write_bytes(b"\0" * 10)
    hour_ago, soon = time.time() - 3600, time.time() + 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(live, (soon, soon))
    data.prepare(cfg_for(story_folder, out), progress=False)
    assert not stale.exists() and live.exists()
    assert (out / ".prepare.lock").read_text() == ""  # not held: no pid written


def test_a_second_preparer_waits_and_then_finds_the_folder_prepared(story_folder, tmp_path, caplog):
    """Two processes preparing one folder: the second waits for the first's lock, removes none of
    its temporary files meanwhile, and then reuses what the first wrote instead of rewriting it."""
    fcntl = pytest.importorskip("fcntl")
    import shutil
    import threading

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    cfg = cfg_for(story_folder, out)
    expected = data.prepare(cfg_for(story_folder, elsewhere), progress=False)
    out.mkdir()
    live = out / ".train.bin.live.tmp"
    result = {}
    with open(out / ".prepare.lock", "a") as lock, caplog.at_level(logging.INFO, logger="oelm_core.data"):
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process, writing
        live.write_bytes(b"\0" * 10)
        second = threading.Thread(target=lambda: result.update(meta=data.prepare(cfg, progress=False)))
        second.start()
        deadline = time.time() + 60
        while "waiting for another process" not in caplog.text and time.time() < deadline:
            time.sleep(0.01)
        assert f"waiting for another process that is preparing {out}" in caplog.text
        assert second.is_alive() and live.exists() and not (out / "train.bin").exists()
        live.unlink()  # the first one finishes: its files are renamed into place
        for name in ("train.bin", "val.bin", "meta.json"):
            shutil.copy2(elsewhere / name, out / name)
        mtime = (out / "train.bin").stat().st_mtime_ns
    second.join(60)
    assert result["meta"] == expected
    assert (out / "train.bin").stat().st_mtime_ns == mtime


# --- the hub, faked -----------------------------------------------------------------------


def test_hub_source_uses_load_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, split, streaming=False):
        calls.append((name, split, streaming))
        return iter([{"text": f"{split} story {i}."} for i in range(5)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr("oelm_core.offline.hub_unreachable", lambda: None)  # the simulated hub answers
    cfg = DataConfig(out_dir=str(tmp_path / "out"), max_train_stories=3, max_val_stories=2)
    meta = data.prepare(cfg, progress=False)
    assert cfg.source == "roneneldan/TinyStories" and meta["source"] == "roneneldan/TinyStories"
    assert calls == [("roneneldan/TinyStories", "train", True), ("roneneldan/TinyStories", "validation", True)]
    np.testing.assert_array_equal(
        read_bin(tmp_path / "out/train.bin"), expected_ids([f"train story {i}." for i in range(3)])
    )
    np.testing.assert_array_equal(
        read_bin(tmp_path / "out/val.bin"), expected_ids(["validation story 0.", "validation story 1."])
    )
    # Already prepared: no hub access needed (works offline).
    assert data.prepare(cfg, progress=False) == meta and len(calls) == 2
    # Without caps the whole split is loaded normally, not streamed.
    data.prepare(DataConfig(out_dir=str(tmp_path / "full")), progress=False)
    assert calls[2:] == [("roneneldan/TinyStories", "train", False), ("roneneldan/TinyStories", "validation", False)]
    assert data.load_meta(tmp_path / "full")["train_stories"] == 5


def fake_hub(datasets, monkeypatch, rows: dict) -> None:
    """The hub's TinyStories, offline: split ("train", "validation") -> its story texts."""
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, split, streaming=False: iter([{"text": t} for t in rows[split]])
    )
    monkeypatch.setattr("oelm_core.offline.hub_unreachable", lambda: None)  # and it answers


def text_hash(splits: dict) -> str:
    """The text hash of split ("train", "val") -> stories: the token layout (format version and
    tokenizer, as JSON), then each split's mark, then each story's UTF-8 length (8 bytes,
    little-endian) and bytes."""
    h = hashlib.sha256(
        json.dumps({"format": data.FORMAT_VERSION, "tokenizer": data.TOKENIZER}, sort_keys=True).encode()
    )
    for split, stories in splits.items():
        h.update(f"\0split:{split}\0".encode())
        for story in stories:
            h.update(len(story.encode()).to_bytes(8, "little") + story.encode())
    return h.hexdigest()


def test_the_same_stories_from_the_hub_and_a_folder_have_one_text_hash(story_folder, tmp_path, monkeypatch):
    """The content hash (what skips a re-run) of the hub is one of its name and caps, that of a
    folder one of its texts: the same stories had no hash in common, and a run could not resume
    from a local copy of the hub's stories. The text hash is of the stories as tokenised, from
    either source, tokenised in one process or several."""
    datasets = pytest.importorskip("datasets")
    train, val = [f"  {s}\n" for s in STORIES * 20], STORIES[:3] * 10  # the hub's rows, unstripped
    fake_hub(datasets, monkeypatch, {"train": train, "validation": val})
    hub = data.prepare(DataConfig(out_dir=str(tmp_path / "hub")), progress=False)
    monkeypatch.setattr(data, "_PARALLEL_MIN_STORIES", 0)
    local = data.prepare(cfg_for(story_folder, tmp_path / "local", num_proc=2), progress=False)
    assert hub["content_hash"] != local["content_hash"]
    assert hub["text_hash"] == local["text_hash"] == text_hash({"train": STORIES * 20, "val": STORIES[:3] * 10})
    assert (hub["train_tokens"], hub["val_tokens"]) == (local["train_tokens"], local["val_tokens"])

    other = [s.replace("Tom", "Tim") for s in STORIES * 20]
    fake_hub(datasets, monkeypatch, {"train": other, "validation": val})
    changed = data.prepare(DataConfig(out_dir=str(tmp_path / "hub")), force=True, progress=False)
    assert changed["text_hash"] == text_hash({"train": other, "val": STORIES[:3] * 10}) != hub["text_hash"]
    assert changed["train_tokens"] == hub["train_tokens"]


def test_a_new_token_layout_changes_the_text_hash(story_folder, tmp_path, monkeypatch):
    """The text hash, which a resume compares before the content hash, held the stories only: a
    FORMAT_VERSION bump (token files laid out anew) left it as it was. It starts with the format
    version and the tokenizer, as the content hash does."""
    cfg = cfg_for(story_folder, tmp_path / "out")
    first = data.prepare(cfg, progress=False)
    monkeypatch.setattr(data, "FORMAT_VERSION", data.FORMAT_VERSION + 1)
    second = data.prepare(cfg, progress=False)
    stories = {"train": STORIES * 20, "val": STORIES[:3] * 10}
    assert second["content_hash"] != first["content_hash"]
    assert second["text_hash"] == text_hash(stories) != first["text_hash"]


TRICKY_STORIES = [
    "Mia ate cr\u00e8me br\u00fbl\u00e9e \U0001f36e and said \u201cyum\u201d.",  # bytes split across tokens
    "A story that says <|endoftext|> in its text, and goes on.",  # plain text, not an EOT
    "Two lines.\r\n\n  Indented, then \u732b (a cat) and a combining e\u0301.",
    "\U0001f600",
]


def test_a_meta_without_text_hash_gets_it_from_the_token_files(tmp_path, monkeypatch, caplog):
    """Data prepared before meta.json held a text hash was reused as it was, so runs on it
    recorded none. prepare adds it from the token files, without tokenising again: the stories
    decoded between EOTs hash exactly as the texts did, also where a character's bytes span two
    tokens or a story holds the text <|endoftext|>."""
    rows = "".join(json.dumps({"text": story}) + "\n" for story in TRICKY_STORIES * 3).encode()
    root = story_files(tmp_path / "src", "p.jsonl", rows, val_text=TRICKY_STORIES[0])
    cfg = cfg_for(root, tmp_path / "out")
    first = data.prepare(cfg, progress=False)
    assert first["text_hash"] == text_hash({"train": TRICKY_STORIES * 3, "val": TRICKY_STORIES[:1]})
    meta_path = tmp_path / "out" / "meta.json"
    old = {k: v for k, v in first.items() if k != "text_hash"}
    meta_path.write_text(json.dumps(old))

    def tokenises(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(data, "_write_split", tokenises)
    with caplog.at_level("INFO", logger="oelm_core.data"):
        assert data.prepare(cfg, progress=False) == first
    assert json.loads(meta_path.read_text()) == first
    assert f"adding the text hash of the stories to {tmp_path / 'out'}/meta.json" in caplog.text
    assert data.prepare(cfg, progress=False) == first  # now up to date as it is


def test_hub_offline_error(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"Hugging Face hub.*Offline\? set data.source .*OELM_DATA.*local folder"):
        data.prepare(DataConfig(out_dir=str(tmp_path / "out")), progress=False)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_missing_local_folder_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    """A folder path that does not exist fails at once, saying so; the hub is not tried (offline
    that costs half a minute of retries and an error about the hub)."""
    datasets = pytest.importorskip("datasets")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append(a))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for source in ("data/tinystories", "./mydata/tinystories", "../mydata", "~/no_such_oelm_folder"):
        with pytest.raises(ConfigError, match=r"data folder .* does not exist"):
            data.prepare(cfg_for(source, tmp_path / "out"), progress=False)
    monkeypatch.setenv("OELM_DATA", "data/tinystories")
    with pytest.raises(ConfigError, match=r"data folder .*data/tinystories does not exist"):
        data.prepare(DataConfig(out_dir=str(tmp_path / "out")), progress=False)
    assert calls == []


def test_hub_failure_of_a_path_like_source_names_the_missing_folder(tmp_path, monkeypatch):
    """ "mydata/tinystories" may be a hub id or a folder meant relative to the working directory:
    when the hub fails, the error says that no such folder exists either."""
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'mydata/tinystories' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"Hugging Face hub.*mydata/tinystories does not exist"):
        data.prepare(cfg_for("mydata/tinystories", tmp_path / "out"), progress=False)


# --- metrics ------------------------------------------------------------------------------


def test_bits_per_byte_and_perplexity():
    # 2.0 nats/token, 1000 tokens over 4000 bytes: 2000 nats / 4000 bytes = 0.5 nats/byte
    # = 0.5 / ln 2 = 0.72135 bits/byte.
    assert batches.bits_per_byte(2.0, 1000, 4000) == pytest.approx(0.7213475204444817)
    assert batches.bits_per_byte(math.log(2), 1, 1) == pytest.approx(1.0)
    assert batches.perplexity(math.log(10.0)) == pytest.approx(10.0)
    assert batches.perplexity(1e6) == float("inf")


# --- the real offline TinyStories ---------------------------------------------------------


@pytest.mark.skipif(not SHARED_STORIES.is_dir(), reason="needs ../shared/data/tinystories")
def test_real_tinystories(tmp_path):
    meta = data.prepare(cfg_for(SHARED_STORIES, tmp_path / "out"), progress=False)
    # ../shared/data/README.md: 3.73M training tokens (7 files), 138k validation tokens
    assert 3.6e6 < meta["train_tokens"] < 3.8e6 and 1.3e5 < meta["val_tokens"] < 1.5e5
    assert meta["val_stories"] == 1  # the shared validation file has no separator: one stream
    x, y = batches.TokenSampler(tmp_path / "out/train.bin", 64, 4, seed=0).next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_sampler_draws_every_window_and_none_past_the_end(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(40, dtype=np.uint16).tofile(path)
    s = batches.TokenSampler(path, block_size=16, batch_size=8, seed=0)
    starts = {int(v) for _ in range(200) for v in s.next_batch()[0][:, 0]}
    assert starts == set(range(24))  # tokens 0..39: windows of 17 start at 0..23


def test_a_truncated_token_file_is_rebuilt(story_folder, tmp_path):
    cfg = DataConfig(source=str(story_folder), out_dir=str(tmp_path / "out"))
    first = data.prepare(cfg, progress=False)
    train = tmp_path / "out" / "train.bin"
    train.write_bytes(train.read_bytes()[:100])
    data.prepare(cfg, progress=False)
    assert train.stat().st_size == 2 * first["train_tokens"]


def test_moving_a_story_boundary_is_new_content(tmp_path):
    root = tmp_path / "s"
    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    (root / "validation" / "v.txt").write_text("Hello world")
    part = root / "train" / "t.txt"
    part.write_text("ab<|endoftext|>cd")
    cfg = DataConfig(source=str(root), out_dir=str(tmp_path / "out"))
    first = data.prepare(cfg, progress=False)
    part.write_text("abc<|endoftext|>d")  # the same characters, another boundary
    second = data.prepare(cfg, progress=False)
    assert second["content_hash"] != first["content_hash"] and second["text_hash"] != first["text_hash"]
    enc = data.get_tokenizer()
    expected = enc.encode_ordinary("abc") + [data.EOT] + enc.encode_ordinary("d") + [data.EOT]
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist() == expected


def test_a_token_file_with_ids_past_the_vocabulary_is_refused_on_opening(tmp_path):
    """A file damaged in place keeps its size: the size check passed it, and its ids reached
    torch.embedding as a bare IndexError deep in the model."""
    path = tmp_path / "train.bin"
    tokens = np.arange(1000, dtype=np.uint16)
    tokens[700] = 65535
    tokens.tofile(path)
    message = (
        r"train\.bin holds 1 token id\(s\) past the 50257-token vocabulary it was prepared with "
        r"\(ids 0\.\.50256\), the largest 65535, the first at position 700: the file was damaged or "
        r"written by something else; rebuild with `python -m oelm_core\.data .* --force`"
    )
    with pytest.raises(ConfigError, match=message):
        batches.TokenSampler(path, block_size=16, batch_size=2, seed=0)
    with pytest.raises(ConfigError, match=message):
        batches.eval_batches(path, block_size=16, batch_size=2, n_batches=1)
    # The vocabulary is the one the file was prepared with, not always GPT-2's.
    with pytest.raises(
        ConfigError,
        match=r"holds 488 token id\(s\) past the 512-token vocabulary .*, the "
        r"largest 65535, the first at position 512: the file was damaged",
    ):
        batches.TokenSampler(path, block_size=16, batch_size=2, seed=0, vocab_size=512)
    tokens[700] = 50256  # GPT-2's end-of-text, the largest id there is
    tokens.tofile(path)
    assert batches.TokenSampler(path, block_size=16, batch_size=2, seed=0).data.max() == 50256


# --- a preparation that fails or is killed leaves the folder as it was ---------------------


def folder_state(out: Path) -> dict:
    """Every file under ``out`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def fails_at(monkeypatch, stage: str) -> None:
    """Make the next preparation fail at ``stage`` (KeyboardInterrupt: a kill that lets Python
    unwind; ConfigError for the tokenizer, as offline without its files)."""
    real_encode, real_temporary = data._encode_chunk, data.write_temporary
    calls = []

    def encode(texts):
        calls.append(len(texts))
        # the second chunk of train.bin; the first of val.bin, after train.bin's 121 stories
        if stage == "train.bin" and len(calls) == 2 or stage == "val.bin" and sum(calls) > 121:
            calls.clear()
            raise KeyboardInterrupt(f"killed while writing {stage}")
        return real_encode(texts)

    def temporary(path, *args, **kwargs):
        if stage == "meta.json" and Path(path).name == "meta.json":
            raise KeyboardInterrupt("killed while writing meta.json")
        return real_temporary(path, *args, **kwargs)

    def no_tokenizer():
        raise ConfigError("tiktoken could not load the 'gpt2' BPE files")

    def read_file(path, text_field):
        raise KeyboardInterrupt("killed while reading the stories")

    monkeypatch.setattr(data, "_CHUNK_STORIES", 16)  # 120 training stories: several chunks
    monkeypatch.setattr(data, "_encode_chunk", encode)
    monkeypatch.setattr(data, "write_temporary", temporary)
    if stage == "tokenizer":
        monkeypatch.setattr(data, "get_tokenizer", no_tokenizer)
    if stage == "stories":
        monkeypatch.setattr(data, "_read_file", read_file)


@pytest.mark.parametrize("stage", ["stories", "tokenizer", "train.bin", "val.bin", "meta.json"])
def test_a_preparation_that_fails_at_any_stage_leaves_the_cache_as_it_was(story_folder, tmp_path, monkeypatch, stage):
    """A failed run (offline, without the tokenizer files) deleted meta.json and left
    .prepare.lock behind. Stories edited since the cache was prepared need a rebuild; whether it
    fails reading the stories, loading the tokenizer, or is killed while writing either token
    file or meta.json, the folder holds exactly what it held, and the next preparation
    rebuilds. A folder that did not exist is not left behind either."""
    out = tmp_path / "cache"
    cfg = cfg_for(story_folder, out, num_proc=1)
    data.prepare(cfg, progress=False)
    before = folder_state(out)
    assert sorted(before) == ["meta.json", "train.bin", "val.bin"]
    with open(story_folder / "train" / "part.txt", "a") as f:
        f.write("\n<|endoftext|>\nA new story about a dog who could sing.\n")
    with monkeypatch.context() as m:
        fails_at(m, stage)
        with pytest.raises((KeyboardInterrupt, ConfigError)):
            data.prepare(cfg, progress=False)
        assert folder_state(out) == before
        with pytest.raises((KeyboardInterrupt, ConfigError)):
            data.prepare(cfg_for(story_folder, tmp_path / "new" / "cache", num_proc=1), progress=False)
        assert not (tmp_path / "new").exists()
    meta = data.prepare(cfg, progress=False)
    assert meta["train_stories"] == 121 and data.load_meta(out) == meta


KILLED_PREPARATION = """import os, signal, sys
from oelm_core import batches, data
from oelm_core.config import DataConfig

real, chunks = data._encode_chunk, []

def encode(texts):
    chunks.append(1)
    if len(chunks) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(texts)

data._CHUNK_STORIES, data._encode_chunk = 16, encode
data.prepare(DataConfig(source=sys.argv[1], out_dir=sys.argv[2], num_proc=1), progress=False)
"""


def test_a_preparation_killed_by_sigkill_leaves_the_cache_whole(story_folder, tmp_path, caplog):
    """A real SIGKILL while train.bin is written (no Python unwinding): the old files stay as
    they were, only a temporary is added, and the next preparation removes it and rebuilds."""
    import subprocess
    import sys

    out = tmp_path / "cache"
    cfg = cfg_for(story_folder, out, num_proc=1)
    data.prepare(cfg, progress=False)
    before = folder_state(out)
    with open(story_folder / "train" / "part.txt", "a") as f:
        f.write("\n<|endoftext|>\nA new story about a dog who could sing.\n")
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_PREPARATION, str(story_folder), str(out)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    after = folder_state(out)
    left = sorted(set(after) - set(before))
    assert {k: after[k] for k in before} == before
    assert len(left) == 2 and left[0] == ".prepare.lock" and left[1].startswith(".train.bin.")
    with caplog.at_level(logging.INFO, logger="oelm_core.data"):
        assert data.prepare(cfg, progress=False)["train_stories"] == 121
    assert sorted(folder_state(out)) == ["meta.json", "train.bin", "val.bin"]
    assert (
        f"preparing {out} from {story_folder}: the stories of {story_folder} changed since it was prepared"
        in caplog.text
    )


def test_a_rebuild_says_why(story_folder, tmp_path, caplog):
    """A token file of another size, an edited hash or count, a damaged meta.json: each rebuild
    says what it found (a warning where something else wrote there)."""
    out = tmp_path / "cache"
    cfg = cfg_for(story_folder, out, num_proc=1)
    meta = data.prepare(cfg, progress=False)
    tokens = meta["train_tokens"]
    cases = [
        (
            lambda: (out / "train.bin").write_bytes((out / "train.bin").read_bytes()[:-3]),
            "WARNING",
            f"train.bin holds {2 * tokens - 3:,} bytes where meta.json records {tokens:,} tokens "
            f"({2 * tokens:,} bytes): damaged, or written by something else",
        ),
        (
            lambda: (out / "meta.json").write_text(json.dumps({**meta, "content_hash": "edited"})),
            "INFO",
            f"the stories of {story_folder} changed since it was prepared (content hash edited... recorded, "
            f"{meta['content_hash'][:12]}... now)",
        ),
        (
            lambda: (out / "meta.json").write_text(json.dumps({**meta, "val_tokens": meta["val_tokens"] + 1})),
            "WARNING",
            f"val.bin holds {2 * meta['val_tokens']:,} bytes where meta.json records {meta['val_tokens'] + 1:,} tokens",
        ),
        (
            lambda: (out / "meta.json").write_text("{"),
            "WARNING",
            "its meta.json is damaged (empty, not JSON or not a mapping)",
        ),
        (lambda: (out / "meta.json").unlink(), "WARNING", "it has train.bin and val.bin but no meta.json"),
    ]
    for damage, level, why in cases:
        damage()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="oelm_core.data"):
            assert data.prepare(cfg, progress=False)["train_tokens"] == tokens
        said = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("preparing")]
        assert len(said) == 1 and said[0][0] == level, said
        assert said[0][1].startswith(f"preparing {out} from {story_folder}: {why}"), said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="oelm_core.data"):
        data.prepare(cfg_for(story_folder, tmp_path / "fresh", num_proc=1), progress=False)
    assert f"preparing {tmp_path / 'fresh'} from {story_folder}: it holds no prepared data yet" in caplog.text


def test_a_full_disk_while_preparing_says_where_and_how_much_and_keeps_the_cache(tmp_path, capsys):
    """Data preparation on a full disk ended in a raw `OSError: [Errno 28]`. On a real 256 KiB
    tmpfs the CLI prints one line naming the device, the token file and what it needs (about
    the file's size, from the tokens per story so far), exits 1 as before, and the cache
    prepared there earlier stays whole, without temporaries."""
    from small_disk import small_disk

    stories = tmp_path / "stories"
    story_files(stories, "a.txt", "\n<|endoftext|>\n".join(STORIES * 10).encode())
    with small_disk(tmp_path / "disk", 256) as disk:
        out = disk.path / "cache"
        assert data.main(["--source", str(stories), "--out-dir", str(out), "--no-progress"]) == 0
        before = folder_state(out)
        capsys.readouterr()
        (stories / "train" / "a.txt").write_text("\n<|endoftext|>\n".join(STORIES * 1000))
        assert data.main(["--source", str(stories), "--out-dir", str(out), "--no-progress", "--num-proc", "1"]) == 1
        err = capsys.readouterr().err
        assert folder_state(out) == before
    expected = 2 * len(expected_ids(STORIES * 1000)) / 1e6
    said = re.fullmatch(
        rf"error: no space left on tmpfs \(mounted at {re.escape(str(disk.path))}\) while writing "
        rf"{re.escape(str(out))}/train\.bin; about ([\d.]+) MB needed, ([\d.]+) MB free there: free "
        rf"some space on it, or set data.out_dir to a folder on another disk\n",
        err,
    )
    assert said, err
    assert float(said.group(1)) == pytest.approx(expected, abs=0.051) and float(said.group(2)) < 0.25  # MB to 0.1
