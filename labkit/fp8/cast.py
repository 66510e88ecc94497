"""An fp32 -> e4m3 cast inside Triton kernels that gives torch's bits in the interpreter as on a GPU.

``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` rounds to nearest, ties to even, and saturates at the largest
finite e4m3 value (448; without the clamp torch makes 500 a NaN). A GPU's ``.to(tl.float8e4nv)`` of clamped
values does the same (``cvt.rn.satfinite.e4m3x2.f32``). Triton 3.9's CPU interpreter does not: it drops a rounding
carry (125.06 -> 64), truncates subnormals and does not saturate. So :func:`to_e4m3` rounds first, in fp32
arithmetic, when ``EXACT`` (the interpreter: :func:`exact`), and the interpreter's cast then only sees values e4m3
holds exactly, which it converts right:

- normals (|x| >= 2^-6): round to nearest even on the fp32 bits, keeping 3 of the 23 mantissa bits;
- subnormals (|x| < 2^-6): round to a multiple of 2^-9 (``x * 512`` rounded to an integer, ties to even, by adding
  and subtracting 1.5 * 2^23: one fp32 rounding);
- first clamped to +-448 (448 is e4m3's: a clamped value never rounds past it); the sign is kept (-0 stays -0).

When not ``EXACT`` (compiled for a GPU) it is the clamp and the hardware's cast. Finite inputs only (a NaN P is a
bug before the cast).

Calling it from a kernel in another module (the notebook's): both forms below compile with Triton 3.9 here (for
sm90, no GPU; tests/labkit/fp8/test_cast.py) and run in its interpreter. The compiler's rule (its code generator's
``global_lookup``, unchanged in substance since Triton 3.2, so 3.6 on the GPU too: read in its source, not run here):
a global read inside ``@triton.jit`` must be a module (``type(val) is ModuleType``: a SimpleNamespace is refused,
though the interpreter accepts it), a jit function, a ``tl.constexpr`` or a triton.language object, and attribute
chains through modules are then followed:

    P8 = lk.fp8cast.to_e4m3(p * p_scale, EXACT)              # lk: the notebook's `import labkit as lk`
    from labkit.fp8.cast import to_e4m3                      # or an imported name
    P8 = to_e4m3(p * p_scale, EXACT)

with ``EXACT: tl.constexpr`` a kernel argument set by the launch to ``lk.fp8cast.exact()``. A plain Python bool
global read inside the kernel would run in the interpreter and be refused by the compiler.

Used in: 10_fp8_attention (exercise 3's kernel).
"""
from __future__ import annotations

import triton
import triton.language as tl

from labkit.tritonlab import mode as tritonmode

MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: (y + MAGIC) - MAGIC rounds |y| < 2^22 to an integer, ties to even


def exact() -> bool:
    """Whether kernels must pre-round before casting to e4m3: True under Triton's interpreter (its cast is wrong),
    False for compiled kernels (the GPU's cast is right). Pass it as the kernel's ``EXACT`` constexpr."""
    return tritonmode.current() == "interpreter"


@triton.jit
def to_e4m3(x, EXACT: tl.constexpr):
    """x: an fp32 block (any shape) -> the same block as tl.float8e4nv, rounded to nearest even and saturated at
    +-448, bit for bit torch's ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``. EXACT: pre-round in fp32 (the
    interpreter); otherwise clamp and cast (a GPU)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EXACT:
        bits = x.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        mag = bits & 0x7FFFFFFF                                            # |x| as bits
        keep_lsb = (mag >> 20) & 1                                         # lowest of the 3 mantissa bits kept
        normal = ((mag + 0x7FFFF + keep_lsb) & 0xFFF00000).to(tl.float32, bitcast=True)   # ties to even
        scaled = mag.to(tl.float32, bitcast=True) * 512.0                  # |x| / 2^-9, exact
        sub = ((scaled + MAGIC) - MAGIC) * (1.0 / 512.0)                   # nearest multiple of 2^-9, ties to even
        rounded = tl.where(mag < 0x3C800000, sub, normal)                  # 0x3C800000: 2^-6, the smallest normal
        x = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)
