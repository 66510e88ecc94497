"""Command line: ``python -m labkit doctor | bench | execute | reference | bundle | longctx | cp-train | board``.

- doctor: device, dtypes, which attention backends run here, and what ``auto`` picks and why;
- bench: the attention sweep to CSV and PNG (``--vs-direct``: labkit against the kernels called directly);
- execute: run every solution notebook here, executed copies and a summary page (instructors);
- reference: store the GPU-only cells' outputs of an executed GPU run, shown to readers without one;
- bundle: the student zip, refused if any solution text would leak (instructors);
- longctx: GPT-2 on one long sequence, labkit vs sdpa tokens/s or the longest N (``lk.longctx``);
- cp-train: GPT-2 on one long sequence across GPUs with context parallelism (``lk.cprun``);
- board: the students' kernels ranked on this GPU, correctness re-checked, cheating flagged (``lk.board``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from labkit.core import cliargs as ca
from labkit.engine.attention import BACKENDS, MODES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COURSE = "the course folder (it holds solutions/)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="device, dtypes and which attention backends run here")
    bench = sub.add_parser("bench", help="attention sweep to CSV and PNG")
    gpu = torch.cuda.is_available()
    bench.add_argument("--seq-lens", type=ca.integers(1, "512,1024"), help="comma-separated sequence lengths N",
                       default=[512, 1024, 2048, 4096, 8192, 16384] if gpu else [128, 256, 512])
    bench.add_argument("--head-dims", type=ca.integers(1, "64,128"), default=[64, 128] if gpu else [64],
                       help="comma-separated head dims D")
    bench.add_argument("--tokens", type=ca.integer(1, 16384), default=16384 if gpu else 1024,
                       help="B*N per configuration")
    bench.add_argument("--width", type=ca.integer(1, 2048), default=2048 if gpu else 256, help="H*D per configuration")
    bench.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if gpu else "fp32", help="input dtype")
    bench.add_argument("--backends", type=ca.names([*BACKENDS, "auto"], "backend"), default=None,
                       help="comma-separated names (default: every backend that runs here, plus auto)")
    bench.add_argument("--modes", type=ca.names(MODES, "mode"), default=list(MODES),
                       help="fwd, fwd_bwd or both (comma-separated)")
    bench.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="causal mask rows to run")
    bench.add_argument("--target-ms", type=ca.number(0, 100), default=100.0, help="timing budget per row")
    bench.add_argument("--out", type=ca.out_folder("build/bench"), default="build/bench", help="output folder")
    bench.add_argument("--vs-direct", action="store_true",
                       help="instead of the sweep: auto and labkit against the kernels called directly, both layouts")
    bench.add_argument("--rounds", type=ca.integer(1, 60), default=60,
                       help="--vs-direct: interleaved timing rounds per row")
    bench.add_argument("--rep-ms", type=ca.number(0, 10), default=10.0,
                       help="--vs-direct: milliseconds of calls per measurement")
    execute = sub.add_parser("execute", help="run the solution notebooks here; copies and summary.md")
    execute.add_argument("--root", type=ca.folder("solutions", COURSE, "'.' run from it"), default=".",
                         help="course folder (holds solutions/)")
    execute.add_argument("--out", type=ca.out_folder("build/execute"), default="build/execute",
                         help="output folder")
    execute.add_argument("--only", type=ca.words("01,03"), default=None,
                         help="comma-separated notebook name prefixes, e.g. 01,03")
    execute.add_argument("--profile", choices=["cpu", "gpu"], default=None, help="default: by device")
    execute.add_argument("--timeout", type=ca.integer(1, 1800), default=1800,
                         help="seconds per cell; a cell past it is recorded as an error and ends its notebook")
    execute.add_argument("--strict", action="store_true",
                         help="a network access or deprecation warning fails its cell (default: reported)")
    reference = sub.add_parser("reference", help="store the GPU-only cells' outputs of an executed run (GPU machine)")
    executed = ca.folder("[0-9][0-9]_*.ipynb", "the folder make execute wrote", "build/execute")
    reference.add_argument("--from", dest="executed", type=executed, default="build/execute",
                           help="folder of executed notebooks (make execute)")
    reference.add_argument("--out", type=ca.out_folder("labkit/course/reference_runs"), default=None,
                           help="default: labkit/course/reference_runs")
    bundle = sub.add_parser("bundle", help="zip the student bundle (no solutions, no hidden tests)")
    bundle.add_argument("--root", type=ca.folder("solutions", COURSE, "'.' run from it"), default=".",
                        help="course folder (holds solutions/)")
    bundle.add_argument("--out", type=ca.out_zip("build/student-bundle.zip"), default="build/student-bundle.zip",
                        help="zip file to write (a name ending in .zip), or an existing folder to write "
                             "student-bundle.zip into")
    sub.add_parser("longctx", add_help=False,  # its options: python -m labkit longctx --help (lk.longctx)
                   help="GPT-2 on one long sequence: labkit vs sdpa tokens/s (compare), the longest N (search)")
    sub.add_parser("cp-train", add_help=False,  # its options: python -m labkit cp-train --help (lk.cprun)
                   help="GPT-2 on one long sequence across GPUs (context parallelism, torchrun)")
    board = sub.add_parser("board", help="rank the students' kernels on this GPU (instructors; lk.board)")
    board.add_argument("assignment", choices=["06_triton_flashattention", "08_decode_attention", "09_flex_attention",
                                              "10_fp8_attention"],
                       help="the assignment whose kernels are ranked")
    board.add_argument("--submitted", type=ca.folder(None, "nbgrader's submitted/ folder", "submitted"),
                       help="folder of <student>/<assignment>/<assignment>.ipynb (submitted/ or autograded/)")
    board.add_argument("--merge", nargs="+", type=ca.folder("board.csv", "a shard's board output (its --out)", "build/board-0"),
                       metavar="BOARD", help="instead of running students: join these board outputs (the --out of each "
                                             "--shard run) into --out")
    board.add_argument("--shard", type=ca.shard(), default=None, metavar="K/N",
                       help="run only every N-th student from the K-th (0 <= K < N; one machine of N; needs --seed)")
    board.add_argument("--gpus", type=ca.integer(1, 2), default=None,
                       help="GPUs used at once, a student on each (default: every visible GPU)")
    board.add_argument("--out", type=ca.out_folder("build/board"), default="build/board", help="output folder")
    board.add_argument("--cpu", action="store_true", help="correctness only, through Triton's interpreter")
    board.add_argument("--timeout", type=ca.integer(1, 900), default=900, help="seconds per student")
    board.add_argument("--seed", type=ca.integer(0, 12345), default=None,
                       help="the inputs' seed (default: a fresh secret one per run)")
    board.add_argument("--anonymize", action="store_true", help="pseudonyms instead of student IDs")
    board.add_argument("--jobs", type=ca.integer(1, 2), default=2, help="students at once on a CPU (on a GPU: --gpus)")
    board.add_argument("--memory-gb", type=ca.number(0, 16), default=None,
                       help="memory limit per student (CPU: address space, default 16; GPU: default 90%% of the card)")
    parser.commands = sub.choices  # each command's parser, for the checks after parsing (_check)
    return parser


def _check(parser: argparse.ArgumentParser, args) -> None:
    """What the options' types cannot check alone; each answers as argparse does (one line, exit status 2)."""
    command = parser.commands[args.command]
    if args.command == "execute" and args.only:
        from labkit.course.execute import solution_notebooks

        have = [p.stem for p in solution_notebooks(args.root)]
        missing = [o for o in args.only if not any(h.startswith(o) for h in have)]
        if missing:
            command.error(f"argument --only: no solution notebook starts with {', '.join(missing)}; "
                          f"the notebooks are {', '.join(have)}; e.g. --only {have[0][:2] if have else '01'}")
    if args.command == "bench" and args.backends and "auto" not in args.backends and not args.vs_direct:
        from labkit.engine.attention import why_not  # a sweep of nothing but "unsupported" rows: say why, and what runs here
        from labkit.core.env import default_device

        device, dtype, first = default_device(), DTYPES[args.dtype], ""
        for backend, head_dim in itertools.product(args.backends, args.head_dims):  # up to the first that runs
            reason = why_not(backend, device=device, dtype=dtype, head_dim=head_dim)
            if reason is None:
                break
            first = first or f"{backend}: {reason.rstrip('.')}"
        else:
            here = [b for b in BACKENDS if not why_not(b, device=device, dtype=dtype)]
            command.error(f"argument --backends: none runs here ({first}); these do: {', '.join(here)}, auto")
    if args.command == "board":
        try:
            from labkit.board.rank import submissions
        except ModuleNotFoundError:
            command.error("the board is an instructor's tool and is not in the student bundle; run it from the course "
                          "repository")

        if (args.submitted is None) == (args.merge is None):
            command.error("give either --submitted (run the students) or --merge (join the shards' boards), not both")
        if args.merge:
            return
        if args.shard and args.seed is None:
            command.error("argument --shard: give every shard the same --seed (the same inputs for the whole class)")
        if not submissions(args.submitted, args.assignment):
            command.error(f"argument --submitted: no {args.submitted}/<student>/{args.assignment}/{args.assignment}"
                          f".ipynb; give nbgrader's layout, e.g. --submitted submitted")
    if args.command == "reference" and not torch.cuda.is_available():
        command.error("reference stores a GPU run's outputs: run it on a machine with a CUDA GPU, after make execute")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cp-train"]:
        from labkit.cp import run as cprun

        return cprun.main(argv[1:])
    if argv[:1] == ["longctx"]:
        from labkit.long import ctx as longctx

        return longctx.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    from labkit.core import plots
    from labkit.engine import bench, doctor

    if args.command == "doctor":
        doctor.report()
        doctor.auto_report()
        return 0
    if args.command == "execute":
        return _execute(args)
    if args.command == "bundle":
        return _bundle(args)
    if args.command == "board":
        return _board(args)
    if args.command == "reference":
        from labkit.course import reference

        for path in reference.build(args.executed, **({"out": args.out} if args.out else {})):
            print(f"wrote {path}")
        return 0
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    configs = bench.fixed_token_configs(args.seq_lens, args.head_dims, tokens=args.tokens, width=args.width)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.vs_direct:
        return _vs_direct(args, configs, causal)
    df = bench.attention_sweep(configs, backends=args.backends, causal=causal, modes=args.modes,
                               dtype=DTYPES[args.dtype], target_ms=args.target_ms,
                               partial_csv=args.out / "attention_sweep.csv")  # rewritten per configuration
    plots.sweep_plot(df, path=args.out / "attention_sweep.png")
    table = df.pivot_table(index=["D", "causal", "N"], columns=["backend", "mode"], values="tflops")
    print(table.to_string(float_format=lambda x: f"{x:.3g}"))
    gap = bench.auto_vs_best(df)
    if not gap.empty:
        gap.to_csv(args.out / "auto_vs_best.csv", index=False)
        print("\nauto vs the fastest backend (auto_over_best >= 0.95 means within 5%):")
        print(gap.round(3).to_string(index=False))
    print(f"wrote {args.out / 'attention_sweep.csv'} and {args.out / 'attention_sweep.png'}")
    return 0


def _vs_direct(args, configs: list[dict], causal: tuple[bool, ...]) -> int:
    from labkit.engine import overhead

    df = overhead.vs_direct(configs, causal=causal, modes=args.modes, rounds=args.rounds,
                            rep_ms=args.rep_ms, dtype=DTYPES[args.dtype], partial_csv=args.out / "vs_direct.csv")
    print(df.drop(columns=["B", "H", *[c for c in df if c.startswith("ms ")]]).round(3).to_string(index=False))
    ratio, slow = df["auto_over_best"], overhead.slow_rows(df)
    print(f"\nauto / best direct call: min {ratio.min():.3f}, median {ratio.median():.3f}, "
          f"rows below 0.97: {len(slow)} of {len(df)}")
    print(f"labkit:<pick> / direct:<pick>: min {df['labkit_over_direct'].min():.3f}, "
          f"median {df['labkit_over_direct'].median():.3f}")
    print(f"control (a kernel against itself): {df['control'].min():.3f} .. {df['control'].max():.3f}")
    if not slow.empty:
        print("rows below 0.97, by cause (pick: auto ran another kernel than the fastest; noise: the same kernel):")
        print(slow[["N", "D", "layout", "causal", "mode", "best", "pick", "auto_over_best", "control", "cause"]]
              .round(3).to_string(index=False))
    print(f"wrote {args.out / 'vs_direct.csv'}")
    return 0


def _execute(args) -> int:
    from labkit.course import execute

    runs = execute.execute_all(args.root, args.out, only=args.only, profile=args.profile, timeout=args.timeout,
                               strict=args.strict)
    for run in runs:
        print(f"{run.name}: {run.seconds:.0f} s, {len(run.errors)} error(s), {len(run.guard_reports)} run-guard "
              f"report(s), GPU-only notices in {run.gpu_only_cells or 'no cell'}")
    print(f"total {sum(r.seconds for r in runs) / 60:.1f} min; wrote {args.out / 'summary.md'}")
    return 1 if any(run.errors or run.guard_reports for run in runs) else 0


def _board(args) -> int:
    import secrets

    from labkit.board import rank as board
    from labkit.board import shards

    gpu = not args.cpu and torch.cuda.is_available()
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    try:
        if args.merge:
            rows, timings, info = shards.merge(args.merge, args.out)
            if info["assignment"] != args.assignment:
                raise ValueError(f"the boards to merge are of {info['assignment']}, not {args.assignment}")
            gpu = info["gpu"]
            table = board.write(rows, timings, args.out, assignment=args.assignment, gpu=gpu)
            (args.out / shards.INFO).write_text(json.dumps(info, indent=1), encoding="utf-8")
        else:
            table = board.board(args.assignment, args.submitted, args.out, seed=seed, timeout=args.timeout, gpu=gpu,
                                anonymize=args.anonymize, jobs=args.jobs, memory_gb=args.memory_gb, gpus=args.gpus,
                                shard=args.shard)
    except (board.BoardSetupError, ValueError) as err:
        print(f"python -m labkit board: error: {err}", file=sys.stderr)
        return 1
    shown = [c for c in ("rank", "student", "status", "score", "best_library", "vs_best_library", "detail")
             if c in table]
    unranked = table["rank"].astype(object).where(table["rank"].notna(), "")   # not pandas' "<NA>"
    print(table[shown].assign(rank=unranked).to_string(index=False, max_colwidth=70, na_rep="",
                                                       float_format=lambda x: f"{x:.3f}"))
    print(f"wrote {args.out / 'board.csv'} and {args.out / 'board.html'}"
          + ("" if gpu else " (correctness only: no GPU or --cpu)"))
    return 0


def _bundle(args) -> int:
    from labkit.course import bundle

    try:
        path = bundle.build_bundle(args.root, args.out)
    except bundle.BundleLeakError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
