"""Compile Triton kernels for NVIDIA GPUs without a GPU; run as a script by :mod:`labkit.tritonlab.compile`.

Reads a JSON job on stdin: ``{"source": module text, "kernels": [{"name", "signature", "constexprs",
"num_warps", "num_stages"}], "archs": [80, 90]}``. Writes one JSON list on stdout: per kernel and
arch ``{"kernel", "arch", "ok", "error", "registers", "spills", "shared_bytes", "mma", "tf32", "mma_ops"}``.
With ``"ttir_only": true`` only the frontend runs (Triton IR, no PTX: much faster) and each row
has ``"low_precision"``: what the kernel computes in bf16/fp16 (:func:`low_precision`).

A script, not a labkit import: it must start with ``TRITON_INTERPRET`` off (``import labkit`` turns
the interpreter on where there is no GPU) and without torch, so a compile costs about a second more
than Triton's own work. Triton's on-disk cache makes a second compile of the same kernel cheap.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile

LOW = ("bf16", "f16")
ARITH = re.compile(r"^(arith\.(addf|subf|mulf|divf|remf|negf|maxnumf|minnumf|maximumf|minimumf)|math\.\w+|tt\.precise_\w+)$")
MOVES = {"tt.trans", "tt.reshape", "tt.broadcast", "tt.expand_dims", "tt.splat", "arith.select", "tt.join", "tt.cat"}
ENDS = {"tt.dot", "tt.store", "tt.descriptor_store"}  # where a value rounded to bf16/fp16 may go


def resource_usage(cubin: bytes) -> dict:
    """Registers and local memory (spills) per thread of a cubin, read by cuobjdump (shipped with triton)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    usage = dict(re.findall(r"\b(REG|LOCAL|STACK):(\d+)", text))
    return {"registers": int(usage["REG"]), "spills": int(usage.get("LOCAL", 0))}


def _error_text(err: BaseException) -> str:
    """The compiler's error and its causes (a helper's error is the cause of the caller's), one per line."""
    chain = [err]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return "\n".join(f"{type(e).__name__}: {e}" for e in chain)


def compile_one(module, kernel: dict, arch: int) -> dict:
    """Compile ``module.<kernel name>`` for ``sm<arch>``: shared memory, the MMA instruction, registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = {"kernel": kernel["name"], "arch": arch, "ok": False, "error": "", "registers": None,
           "spills": None, "shared_bytes": None, "mma": None, "tf32": None}
    fn = getattr(module, kernel["name"])
    src = ASTSource(fn=fn, signature=kernel["signature"], constexprs=kernel["constexprs"])
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # ptxas' reproducer text on a failure
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"]})
    except Exception as err:  # noqa: BLE001 - the compiler's own message goes back to the notebook
        row["error"] = _error_text(err)
        return row
    ptx = compiled.asm["ptx"]
    row.update(ok=True, shared_bytes=int(compiled.metadata.shared), **resource_usage(compiled.asm["cubin"]),
               mma="wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else None,
               tf32=bool(re.search(r"\b(?:wgmma\.mma_async|mma\.sync)\S*\.tf32\b", ptx)),
               mma_ops=sorted(set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\S*", ptx))))
    return row


def _frames(loc: str, defs: dict, depth: int = 0) -> list:
    """The (file, line) frames of an MLIR location, innermost first (an inlined helper's line, then its caller's)."""
    loc = loc.strip()
    if depth > 64 or not loc or loc == "unknown":
        return []
    if loc.startswith("#loc"):
        return _frames(defs.get(loc, ""), defs, depth + 1)
    if loc.startswith("callsite("):
        inner, outer = loc[len("callsite("):-1].rsplit(" at ", 1)
        return _frames(inner, defs, depth + 1) + _frames(outer, defs, depth + 1)
    if loc.startswith("fused"):
        return [f for part in re.findall(r"#loc\d+", loc) for f in _frames(part, defs, depth + 1)]
    named = re.match(r'^"[^"]*"\((.*)\)$', loc)
    if named:
        return _frames(named.group(1), defs, depth + 1)
    place = re.match(r'^"([^"]*)":(\d+):\d+', loc)
    return [(place.group(1), int(place.group(2)))] if place else []


def _ops(ttir: str) -> list:
    """(result, op, operands, result element type, location, scope) per operation of a Triton IR module's text.

    ``scope``: the regions (loop bodies, branches, reductions) the operation sits in, outermost first, one number
    each: MLIR reuses value names in sibling regions, so a name means a value only within its scope.
    """
    ops, scope, regions = [], (), 0
    for line in ttir.splitlines():
        text = line.strip()
        if text.startswith("}"):        # "}", "} else {", "}) : ...": a region ends
            scope = scope[:-1]
        m = re.match(r'^\s*(?:(%[\w.]+)(?::\d+)?\s*=\s*)?"?([a-z_]+\.[\w.]+)"?(.*?)(?:\s+loc\((.*)\))?\s*$', line)
        if m and not text.startswith(("#loc", "module", "tt.func")):
            result, op, rest, loc = m.groups()
            types = re.findall(r"(?:x|\b)(bf16|f16|f32|f64|i\d+)\b", rest.rsplit(" : ", 1)[-1] if " : " in rest else "")
            args = {a.split("#")[0] for a in re.findall(r"%[\w.#]+", rest)}
            ops.append((result, op, args, types[-1] if types else "", loc or "", scope))
        if text.endswith("{"):          # a region begins (the operation's own result belongs outside it)
            regions += 1
            scope += (regions,)
    return ops


def low_precision(ttir: str, path: str, source: str) -> list:
    """Where a kernel computes in bf16/fp16: ``[function, statement, kind, op, type]`` per statement of ``source``.

    Two findings, both read from the Triton IR (what the GPU runs; the interpreter computes bf16 its own way):
    arithmetic, exp/log or a reduction (tl.max, tl.sum) on bf16/fp16 values; and a value rounded to
    bf16/fp16 (``.to(...)``) that goes anywhere but a ``tl.dot`` operand or a ``tl.store``. ``kind`` is
    "computed" (``op`` ran on ``type``) or "rounded" (the statement rounds to ``type``, then ``op`` uses it).
    """
    defs = dict(re.findall(r"^(#loc\d+) = loc\((.*)\)\s*$", ttir, re.M))
    ops = _ops(ttir)
    defined = {(scope, r) for r, _, _, _, _, scope in ops if r}

    def seen(args: set, scope: tuple) -> set:
        """The (scope, name) definitions that ``args``, used inside ``scope``, refer to: each name's innermost one."""
        keys = set()
        for name in args:
            where = scope
            while where and (where, name) not in defined:
                where = where[:-1]
            keys.add((where, name))
        return keys

    origin = {(scope, r): (loc, ty) for r, op, _, ty, loc, scope in ops if op == "arith.truncf" and ty in LOW}
    for _ in range(len(ops)):  # through views (expand_dims, broadcast, trans, ...) to the real use
        grown = {}
        for r, op, args, _, _, scope in ops:
            rounded = seen(args, scope) & origin.keys() if op in MOVES and r and (scope, r) not in origin else set()
            if rounded:
                grown[(scope, r)] = origin[next(iter(rounded))]
        if not grown:
            break
        origin.update(grown)
    lines = source.splitlines()
    funcs = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]

    def place(loc: str) -> tuple:
        here = [line for file, line in _frames(loc, defs) if file == path]
        if not here:
            return "?", "?"
        return next((f for a, b, f in funcs if a <= here[0] <= b), "?"), lines[here[0] - 1].strip()

    found: dict = {}
    for r, op, args, ty, loc, scope in ops:
        if ARITH.match(op) and ty in LOW:
            found.setdefault(place(loc), ["computed", op, ty])
        for arg in seen(args, scope) & origin.keys():
            if op not in MOVES | ENDS:
                found.setdefault(place(origin[arg][0]), ["rounded", op, origin[arg][1]])
    return [[fn, stmt, *what] for (fn, stmt), what in found.items()]


def ttir_one(module, kernel: dict, arch: int, path: str, source: str) -> dict:
    """The frontend only (Triton IR for ``sm<arch>``): what ``module.<kernel name>`` computes in bf16/fp16."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    row = {"kernel": kernel["name"], "arch": arch, "ok": False, "error": "", "registers": None, "spills": None,
           "shared_bytes": None, "mma": None, "tf32": None, "low_precision": []}
    src = ASTSource(fn=getattr(module, kernel["name"]), signature=kernel["signature"], constexprs=kernel["constexprs"])
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"],
                                     **src.parse_options()})
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    try:
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                          context)
        ttir = str(stages["ttir"](mod, {"target": target, **options.__dict__}))
    except Exception as err:  # noqa: BLE001 - the frontend's own message goes back to the notebook
        row["error"] = _error_text(err)
        return row
    row.update(ok=True, low_precision=low_precision(ttir, path, source))
    return row


def main() -> None:
    job = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "notebook_kernels.py")  # a real file: @triton.jit reads its source
        with open(path, "w") as f:
            f.write(job["source"])
        spec = importlib.util.spec_from_file_location("notebook_kernels", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if job.get("ttir_only"):
            rows = [ttir_one(module, kernel, arch, path, job["source"]) for kernel in job["kernels"]
                    for arch in job["archs"]]
        else:
            rows = [compile_one(module, kernel, arch) for kernel in job["kernels"] for arch in job["archs"]]
    json.dump(rows, sys.stdout)


if __name__ == "__main__":
    main()
