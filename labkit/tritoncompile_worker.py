"""Compile Triton kernels for NVIDIA GPUs without a GPU; run as a script by :mod:`labkit.tritoncompile`.

Reads a JSON job on stdin: ``{"source": module text, "kernels": [{"name", "signature", "constexprs",
"num_warps", "num_stages"}], "archs": [80, 90]}``. Writes one JSON list on stdout: per kernel and
arch ``{"kernel", "arch", "ok", "error", "registers", "spills", "shared_bytes", "mma", "tf32"}``.

A script, not a labkit import: it must start with ``TRITON_INTERPRET`` off (``import labkit`` turns
the interpreter on where there is no GPU) and without torch, so a compile costs about a second more
than Triton's own work. Triton's on-disk cache makes a second compile of the same kernel cheap.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile


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
        chain = [err]
        while chain[-1].__cause__ is not None:  # a helper's error is the cause of the caller's
            chain.append(chain[-1].__cause__)
        row["error"] = "\n".join(f"{type(e).__name__}: {e}" for e in chain)
        return row
    ptx = compiled.asm["ptx"]
    row.update(ok=True, shared_bytes=int(compiled.metadata.shared), **resource_usage(compiled.asm["cubin"]),
               mma="wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else None,
               tf32=bool(re.search(r"\b(?:wgmma\.mma_async|mma\.sync)\S*\.tf32\b", ptx)))
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
        rows = [compile_one(module, kernel, arch) for kernel in job["kernels"] for arch in job["archs"]]
    json.dump(rows, sys.stdout)


if __name__ == "__main__":
    main()
