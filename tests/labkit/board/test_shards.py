"""Tests for a class on several GPUs and machines (``labkit.board.shards``; ``board --gpus/--shard/--merge``).

The students' runs are replaced by a fake :func:`labkit.board.rank.run_student` (the real worker is tested in
test_board.py): these tests are about who runs where and when, and what the merge makes of the shards' outputs.
"""
from __future__ import annotations

import json
import threading
import time

import pandas as pd
import pytest

from board_fixture import write_submitted
from labkit.__main__ import main
from labkit.board import rank as board, shards

ASSIGNMENT = "08_decode_attention"
STUDENTS = ["ana", "bo", "chen", "dai", "eli"]


def test_the_shards_split_the_class_once_and_in_a_stable_order():
    found = {s: f"{s}.ipynb" for s in reversed(STUDENTS)}
    parts = [shards.pick(found, (k, 3)) for k in range(3)]
    assert [list(p) for p in parts] == [["ana", "dai"], ["bo", "eli"], ["chen"]]
    assert shards.pick(found, None) == found


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "1/0"])
def test_a_shard_outside_its_range_is_refused_before_any_work(text, tmp_path, capsys):
    write_submitted(tmp_path / "submitted", ASSIGNMENT, ["ok"])
    with pytest.raises(SystemExit) as exit_:
        main(["board", ASSIGNMENT, "--submitted", str(tmp_path / "submitted"), "--shard", text, "--seed", "1"])
    assert exit_.value.code == 2 and "--shard" in capsys.readouterr().err


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert shards.visible_gpus() == ["3", "5"] and shards.visible_gpus(1) == ["3"]
    with pytest.raises(ValueError, match="shows 2 GPU"):
        shards.visible_gpus(3)


def test_a_worker_on_a_gpu_sees_only_its_own(tmp_path):
    assert board._env(tmp_path, True, "2")["CUDA_VISIBLE_DEVICES"] == "2"
    assert board._env(tmp_path, False, None)["CUDA_VISIBLE_DEVICES"] == ""


def _fake_runs(monkeypatch, seconds=0.0):
    """run_student replaced: records (student, gpu_id, start, end) and returns an ok row scored by the name."""
    calls, lock = [], threading.Lock()

    def fake(assignment, notebook, *, seed, timeout, gpu, logs, student, memory_gb=None, gpu_id=None, **_):
        start = time.monotonic()
        time.sleep(seconds)
        (logs / f"{student}.log").write_text(f"{student} on {gpu_id}\n", encoding="utf-8")
        with lock:
            calls.append((student, gpu_id, start, time.monotonic()))
        return {"status": "ok", "detail": "", "timing": {"student": {"score": len(student) / 10}} if gpu else None,
                "seconds": seconds}

    monkeypatch.setattr(board, "run_student", fake)
    monkeypatch.setattr(board, "probe", lambda *a, **k: None)
    return calls


def test_one_student_per_gpu_at_once_over_every_gpu(tmp_path, monkeypatch):
    calls = _fake_runs(monkeypatch, seconds=0.3)
    monkeypatch.setattr(shards, "visible_gpus", lambda count=None: ["0", "1", "2"][:count])
    monkeypatch.setattr("torch.cuda.device_count", lambda: 3)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda i: "H100")
    write_submitted(tmp_path / "submitted", ASSIGNMENT, ["ok", "wrong", "flagged", "error"])
    table = board.board(ASSIGNMENT, tmp_path / "submitted", tmp_path / "out", seed=1, timeout=60, gpu=True, gpus=2)
    at_once = max(sum(s <= start < e for _, _, s, e in calls) for _, _, start, _ in calls)
    assert len(table) == 4 and at_once == 2, f"two GPUs: two students at once, not {at_once}"
    assert {gpu for _, gpu, _, _ in calls} == {"0", "1"}, "--gpus 2: the first two GPUs, each used"
    for i, (_, gpu_a, start_a, end_a) in enumerate(calls):
        for _, gpu_b, start_b, end_b in calls[i + 1:]:
            assert gpu_a != gpu_b or end_a <= start_b or end_b <= start_a, "two students shared a GPU at once"
    info = json.loads((tmp_path / "out" / "info.json").read_text())
    assert info["gpu_ids"] == ["0", "1"] and info["devices"] == ["H100"] and len(info["students"]) == 4


def _shard_runs(tmp_path, monkeypatch, seeds=(5, 5)):
    _fake_runs(monkeypatch)
    write_submitted(tmp_path / "submitted", ASSIGNMENT, ["ok", "wrong", "flagged"])
    outs = []
    for k, seed in enumerate(seeds):
        outs.append(tmp_path / f"board-{k}")
        argv = ["board", ASSIGNMENT, "--submitted", str(tmp_path / "submitted"), "--out", str(outs[-1]), "--cpu",
                "--seed", str(seed), "--shard", f"{k}/{len(seeds)}"]
        assert main(argv) == 0
    return outs


def test_the_merge_of_the_shards_is_the_whole_class(tmp_path, monkeypatch, capsys):
    outs = _shard_runs(tmp_path, monkeypatch)
    parts = [pd.read_csv(o / "board.csv")["student"].tolist() for o in outs]
    assert sorted(parts[0] + parts[1]) == ["flagged", "ok", "wrong"] and not set(parts[0]) & set(parts[1])
    assert main(["board", ASSIGNMENT, "--merge", *map(str, outs), "--out", str(tmp_path / "all")]) == 0
    merged = pd.read_csv(tmp_path / "all" / "board.csv")
    assert sorted(merged["student"]) == ["flagged", "ok", "wrong"]
    assert sorted(p.name for p in (tmp_path / "all" / "logs").iterdir()) == ["flagged.log", "ok.log", "wrong.log"]
    info = json.loads((tmp_path / "all" / "info.json").read_text())
    assert info["shard"] is None and info["merged_from"] == [str(o) for o in outs] and info["seed"] == 5
    assert (tmp_path / "all" / "board.html").exists() and "flagged" in capsys.readouterr().out


def test_shards_of_another_seed_or_overlapping_are_not_merged(tmp_path, monkeypatch, capsys):
    outs = _shard_runs(tmp_path, monkeypatch, seeds=(5, 6))
    assert main(["board", ASSIGNMENT, "--merge", *map(str, outs), "--out", str(tmp_path / "all")]) == 1
    assert "seed 6 != 5" in capsys.readouterr().err
    assert main(["board", ASSIGNMENT, "--merge", str(outs[0]), str(outs[0]), "--out", str(tmp_path / "all")]) == 1
    assert "the shards overlap" in capsys.readouterr().err
    assert main(["board", "06_triton_flashattention", "--merge", str(outs[0]), "--out", str(tmp_path / "x")]) == 1
    assert f"are of {ASSIGNMENT}" in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [(["--shard", "0/2"], "same --seed"), (["--merge", "shard"], "not both")])
def test_options_that_do_not_go_together(extra, says, tmp_path, capsys, monkeypatch):
    write_submitted(tmp_path / "submitted", ASSIGNMENT, ["ok"])
    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "board.csv").write_text("student,status\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["board", ASSIGNMENT, "--submitted", str(tmp_path / "submitted"), *extra])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
