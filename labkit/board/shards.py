"""A class on several GPUs and several machines: one student per GPU at once, shards, and their merge.

- :func:`visible_gpus`: the GPUs a board run may use (the ids ``CUDA_VISIBLE_DEVICES`` names, or all of them).
- :class:`GpuSlots`: a pool of GPU ids; each student's worker holds one for its whole run (its timings never share a
  GPU), pinned to it through its own ``CUDA_VISIBLE_DEVICES``.
- :func:`pick`: this machine's share of the students (``--shard K/N``: every N-th student from the K-th, of the
  sorted list), for a Slurm job array or any N machines that see the same ``submitted/`` folder.
- :func:`write_info` / :func:`merge`: each board output holds ``info.json`` (assignment, seed, devices, shard,
  students); ``--merge`` joins the outputs of the shards into one board, after checking they belong together.

Used by: :mod:`labkit.board.rank`, ``python -m labkit board``.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import shutil
from pathlib import Path
from typing import Iterator

import pandas as pd

INFO = "info.json"


def visible_gpus(count: int | None = None) -> list[str]:
    """The ids of the GPUs to use, as the workers' ``CUDA_VISIBLE_DEVICES`` takes them: those this process may see
    (its own ``CUDA_VISIBLE_DEVICES``, else ``0 .. device_count - 1``), the first ``count`` (default: all).

    Raises ValueError when ``count`` is more than there are."""
    import torch

    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    ids = named if named else [str(i) for i in range(torch.cuda.device_count())]
    if count is not None and count > len(ids):
        raise ValueError(f"--gpus {count}: this machine shows {len(ids)} GPU(s) ({', '.join(ids) or 'none'})")
    return ids[:count] if count else ids


class GpuSlots:
    """A pool of GPU ids (None for each CPU job slot): :meth:`hold` lends one for a ``with`` block and takes it back,
    even on an error."""

    def __init__(self, ids: list):
        if not ids:
            raise ValueError("no GPU to run the students on")
        self.ids = list(ids)
        self.size = len(self.ids)
        self._free: queue.Queue = queue.Queue()
        for gpu_id in self.ids:
            self._free.put(gpu_id)

    @contextlib.contextmanager
    def hold(self) -> Iterator[str]:
        gpu_id = self._free.get()
        try:
            yield gpu_id
        finally:
            self._free.put(gpu_id)


def pick(found: dict[str, Path], shard: tuple[int, int] | None) -> dict[str, Path]:
    """The students of shard ``(k, n)``: every n-th of the sorted names from the k-th (all of them for None)."""
    if shard is None:
        return dict(found)
    k, n = shard
    return {s: found[s] for i, s in enumerate(sorted(found)) if i % n == k}


def write_info(out: Path, *, assignment: str, seed: int, gpu: bool, gpu_ids: list[str],
               shard: tuple[int, int] | None, students: list[str]) -> Path:
    """``out/info.json``: what a merge checks (assignment, seed, devices) and what the run covered."""
    devices = []
    if gpu:
        import torch

        devices = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    info = dict(assignment=assignment, seed=seed, gpu=gpu, devices=devices, gpu_ids=gpu_ids,
                shard=f"{shard[0]}/{shard[1]}" if shard else None, students=students,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    path = Path(out) / INFO
    path.write_text(json.dumps(info, indent=1), encoding="utf-8")
    return path


def _info(folder: Path) -> dict:
    path = Path(folder) / INFO
    if not (path.exists() and (Path(folder) / "board.csv").exists()):
        raise ValueError(f"{folder} is not a board's output (no {INFO} and board.csv): give the --out folders of the "
                         f"shards' runs")
    return json.loads(path.read_text(encoding="utf-8"))


def merge(folders: list[Path], out: Path) -> tuple[pd.DataFrame, dict, dict]:
    """Join the board outputs ``folders`` (one per shard) into ``out``: their rows (re-ranked by the caller), their
    timings and their logs. Returns (rows, timings, info).

    Raises ValueError when they do not belong together: another assignment, another seed (other inputs), a GPU
    run beside a CPU one, a student in two of them, or GPUs of different kinds (scores are fractions of each
    GPU's own measured limit, but the library kernels' lines would mix two machines)."""
    infos = [_info(f) for f in folders]
    first = infos[0]
    for folder, info in zip(folders[1:], infos[1:]):
        for key in ("assignment", "seed", "gpu", "devices"):
            if info[key] != first[key]:
                raise ValueError(f"{folder} is another run than {folders[0]}: {key} {info[key]!r} != {first[key]!r} "
                                 f"(run every shard with the same assignment, --seed and kind of GPU)")
    seen: dict[str, Path] = {}
    for folder, info in zip(folders, infos):
        for student in info["students"]:
            if student in seen:
                raise ValueError(f"{student} is in both {seen[student]} and {folder}: the shards overlap")
            seen[student] = folder
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows, timings = [], {}
    for folder in folders:
        rows.append(pd.read_csv(Path(folder) / "board.csv").drop(columns=["rank"], errors="ignore"))
        timings.update(json.loads((Path(folder) / "timings.json").read_text(encoding="utf-8")))
        for log in (Path(folder) / "logs").glob("*.log"):
            if log.name != "_probe.log" and Path(folder).resolve() != Path(out).resolve():
                shutil.copy2(log, logs / log.name)
    merged = dict(first, shard=None, students=sorted(seen), merged_from=[str(f) for f in folders])
    return pd.concat(rows, ignore_index=True), timings, merged
