"""Checkpoints: a round trip rebuilds the same model, a failed write keeps the previous file,
and files of another format or shape are refused with an error that says what to do."""

import dataclasses
import os
import re

import pytest
import torch

from oelm_core.checkpoint import CheckpointError, load_checkpoint, load_model, save_checkpoint
from oelm_core.model import build_model


def state_of(model) -> dict:
    return {"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg), "step": 3}


def test_round_trip_rebuilds_the_same_model(tmp_path):
    model = build_model("tiny", "oelm_freeze", seed=1).eval()
    save_checkpoint(state_of(model), tmp_path / "m.pt")
    loaded, state = load_model(tmp_path / "m.pt")
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    assert state["step"] == 3 and state["format_version"] == 1
    assert torch.equal(loaded(x), model(x))  # logits, frozen Q/K buffers included
    assert [n for n, _ in loaded.named_buffers()] == [n for n, _ in model.named_buffers()]


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(state_of(build_model("tiny", seed=1)), path)
    before = path.read_bytes()

    def dies_half_way(obj, f):
        f.write(b"\x00" * 100)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(state_of(build_model("tiny", seed=2)), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary left behind


def test_a_run_folder_is_named_as_a_folder_with_the_file_to_pass(tmp_path):
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    with pytest.raises(
        CheckpointError, match=r"run is a folder, not a checkpoint file: pass a \.pt file such as .*ckpt/step_\*\.pt"
    ):
        load_checkpoint(run)
    save_checkpoint(state_of(build_model("tiny", seed=1)), run / "best.pt")
    with pytest.raises(
        CheckpointError, match=r"run is a folder, not a checkpoint file: pass a \.pt file such as .*run/best\.pt$"
    ):
        load_checkpoint(run)


class NotAllowed:
    """An object that weights_only loading must refuse to unpickle."""


def test_a_checkpoint_holding_arbitrary_objects_is_refused(tmp_path):
    """torch's message runs on for lines of advice; the error names the refused object."""
    path = tmp_path / "pickled.pt"
    torch.save({"format_version": 1, **state_of(build_model("tiny", seed=1)), "extra": NotAllowed()}, path)
    with pytest.raises(
        CheckpointError,
        match=rf"^checkpoint {path} holds code, not only weights: it names the "
        r"Python object `\S*NotAllowed`, which unpickling would import and "
        r"call \(weights-only loading allows no such object\)",
    ):
        load_checkpoint(path)


class RunsAShellCommand:
    """What a malicious checkpoint holds: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


def test_a_malicious_checkpoint_names_the_blocked_call_and_runs_nothing(tmp_path):
    """torch 2.13 refuses it; the message read only "Weights only load failed ... truncated or
    not an OELM checkpoint", never saying what was blocked or that the file holds code."""
    import pickle

    marker = tmp_path / "pwned.txt"
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, **state_of(build_model("tiny", seed=1)), "x": RunsAShellCommand(marker)}, path)
    blocked = f"{os.system.__module__}.system"  # posix.system (nt.system on Windows)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (
        f"checkpoint {path} holds code, not only weights: it names the Python object `{blocked}`, which "
        f"unpickling would import and call (its module {os.system.__module__} is one weights-only loading "
        f"always blocks: it reaches the interpreter and the operating system, to run programs and touch "
        f"files); weights-only loading refused it, so nothing in the file "
        f"ran. OELM checkpoints hold tensors, numbers, strings, lists and dicts only: do not load this one with "
        f"weights_only=False unless you trust where it came from; use a checkpoint of a run folder (best.pt "
        f"or ckpt/step_*.pt) or train again"
    )
    assert isinstance(exc.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()  # nothing ran
    with pytest.raises(CheckpointError, match=rf"names the Python object `{blocked}`"):
        load_model(path)


def test_a_truncated_checkpoint_names_torchs_first_sentence_whole(tmp_path):
    path = save_checkpoint(state_of(build_model("tiny", seed=1)), tmp_path / "cut.pt")
    path.write_bytes(path.read_bytes()[:-100])  # its end, the zip's central directory, is missing
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert (
        "could not be read (RuntimeError: PytorchStreamReader failed reading zip archive: failed "
        "finding central directory.); the file is truncated"
    ) in str(exc.value)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"could not be read \(EOFError\); "):
        load_checkpoint(path)


def test_other_formats_and_shapes_are_refused(tmp_path):
    model = build_model("tiny", seed=1)
    future = tmp_path / "future.pt"
    torch.save({"format_version": 2, **state_of(model)}, future)
    with pytest.raises(CheckpointError, match="has checkpoint format 2; this oelm_core reads format 1"):
        load_checkpoint(future)
    bad_shape = state_of(model)
    bad_shape["model_config"]["n_head"] = 3  # does not divide d_model: no model to rebuild
    save_checkpoint(bad_shape, tmp_path / "bad.pt")
    with pytest.raises(
        CheckpointError, match=r"bad.pt holds no model this oelm_core can rebuild \(n_head=3 does not divide"
    ):
        load_model(tmp_path / "bad.pt")


def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_refused(tmp_path):
    m = build_model("tiny", "gpt_base", seed=1)
    cfg = dataclasses.asdict(m.cfg)
    cfg["tie_embeddings"] = False  # lm_head.weight is missing from the state
    save_checkpoint({"model": m.state_dict(), "model_config": cfg}, tmp_path / "x.pt")
    with pytest.raises(
        CheckpointError,
        match=r"x.pt holds weights that do not fit its model_config: model_config"
        r"\.tie_embeddings is false in the checkpoint, true in the weights \(lm_head\.weight\)",
    ):
        load_model(tmp_path / "x.pt")


def test_a_full_disk_while_saving_says_where_and_how_much_and_loses_nothing(
    no_data_override, tmp_path, folded, capsys, monkeypatch
):  # no_data_override first: the folded corpus must be the test's stories, not OELM_DATA's
    """The disk filled while a checkpoint was written: chained tracebacks ending in torch's
    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos". On a real 2 MB
    tmpfs the run now ends with one line naming the device, the file and what it needs (the
    exit code stays 1, a crash's), the previous checkpoint and no temporary stay, and once there
    is room --resume ends where an uninterrupted run ends."""
    from small_disk import small_disk
    from train_helpers import params, run, write_params

    from oelm_core.files import device_of
    from oelm_core.train import main

    monkeypatch.delenv("OELM_DATA", raising=False)
    common = dict(steps=6, ckpt_every=2, eval_every=2, keep_last=10)
    full = run(params(tmp_path, folded, out="full", **common))
    with small_disk(tmp_path / "disk", 2048) as disk:
        values = params(tmp_path, folded, **common)
        values["out_dir"] = str(disk.path / "run")
        assert main(["--params", str(write_params(tmp_path / "p.yaml", values))]) == 1
        err = capsys.readouterr().err
        out, ckpt = disk.path / "run", disk.path / "run" / "ckpt"
        said = re.fullmatch(
            rf"error: no space left on {re.escape(device_of(disk.path))} while writing "
            rf"{re.escape(str(out))}/(best\.pt|ckpt/step_\d{{7}}\.pt); about (\d\.\d) MB needed, "
            rf"(\d\.\d) MB free there: free some space on it, or set out_dir to a folder on "
            rf"another disk\n",
            err,
        )
        assert said and "Traceback" not in err and device_of(disk.path).startswith("tmpfs (mounted at"), err
        # What it needs: the size of that file in the uninterrupted run, and more than there was.
        size = (tmp_path / "full" / said.group(1)).stat().st_size / 1e6
        assert float(said.group(2)) == pytest.approx(size, abs=0.1) and float(said.group(3)) < size
        saved = sorted(p.name for p in ckpt.iterdir())
        assert saved and all(not n.startswith(".") for n in saved)  # no temporary left
        load_checkpoint(ckpt / saved[-1])
        disk.resize(16384)
        done = run(values, resume=True)
    assert done["status"] == "completed" and done["best_val_loss"] == pytest.approx(full["best_val_loss"], abs=1e-6)
    assert done["final_train_loss"] == pytest.approx(full["final_train_loss"], abs=1e-6)
