"""labkit.tritonlab.compile_worker.low_precision on Triton IR text: value names are scoped by region.

MLIR numbers values afresh in each sibling region (two loops one after the other both have a ``%6``), so a name
rounded to bf16 for a ``tl.dot`` in one loop says nothing of the same name in the next loop.
"""
from __future__ import annotations

from labkit.tritonlab.compile_worker import low_precision

SOURCE = "\n".join(["def kernel(x_ptr, n):",            # line 1
                    "    acc = first_loop(x_ptr)",      # line 2
                    "    p16 = acc.to(tl.bfloat16)",    # line 3: rounded for the dot
                    "    acc = tl.dot(p16, x, acc)",    # line 4
                    "    acc = acc * acc",              # line 5: fp32 work in the second loop
                    "    acc = p16 + p16",              # line 6: a rounded value computed on (the mistake)
                    ""])
LOCS = "\n".join(f'#loc{i} = loc("/k.py":{i}:4)' for i in range(1, 7))


def _ttir(second_loop_body: str) -> str:
    """A module with two sibling scf.for loops: the first rounds %6 to bf16 for a dot, the second's body given."""
    return f"""module {{
  tt.func public @kernel(%arg0: !tt.ptr<bf16>, %arg1: i32) attributes {{noinline = false}} {{
    %0 = scf.for %arg2 = %c0_i32 to %arg1 step %c1_i32 iter_args(%arg3 = %cst) -> (tensor<16x16xf32>)  : i32 {{
      %5 = tt.load %ptrs : tensor<16x16x!tt.ptr<bf16>> loc(#loc2)
      %6 = arith.truncf %arg3 : tensor<16x16xf32> to tensor<16x16xbf16> loc(#loc3)
      %7 = tt.dot %6, %5, %arg3 : tensor<16x16xbf16> * tensor<16x16xbf16> -> tensor<16x16xf32> loc(#loc4)
      scf.yield %7 : tensor<16x16xf32> loc(#loc4)
    }} loc(#loc2)
    %1 = scf.for %arg2 = %c0_i32 to %arg1 step %c1_i32 iter_args(%arg3 = %0) -> (tensor<16x16xf32>)  : i32 {{
{second_loop_body}
    }} loc(#loc5)
    tt.return loc(#loc1)
  }} loc(#loc1)
}} loc(#loc1)
{LOCS}
"""


def test_a_name_reused_in_a_sibling_loop_is_another_value():
    fp32_body = ("      %6 = arith.mulf %arg3, %arg3 : tensor<16x16xf32> loc(#loc5)\n"
                 "      %7 = arith.addf %6, %arg3 : tensor<16x16xf32> loc(#loc5)\n"
                 "      scf.yield %7 : tensor<16x16xf32> loc(#loc5)")
    assert low_precision(_ttir(fp32_body), "/k.py", SOURCE) == []


def test_a_rounded_value_used_in_a_nested_region_is_still_seen():
    nested = _ttir("      %6 = arith.mulf %arg3, %arg3 : tensor<16x16xf32> loc(#loc5)\n"
                   "      scf.yield %6 : tensor<16x16xf32> loc(#loc5)").replace(
        "      scf.yield %7 : tensor<16x16xf32> loc(#loc4)\n",
        "      %8 = scf.if %c {\n"
        "        %9 = arith.extf %6 : tensor<16x16xbf16> to tensor<16x16xf32> loc(#loc6)\n"
        "        scf.yield %9 : tensor<16x16xf32> loc(#loc6)\n"
        "      } else {\n"
        "        scf.yield %7 : tensor<16x16xf32> loc(#loc6)\n"
        "      } loc(#loc6)\n"
        "      scf.yield %8 : tensor<16x16xf32> loc(#loc4)\n")
    assert low_precision(nested, "/k.py", SOURCE) == [["kernel", "p16 = acc.to(tl.bfloat16)", "rounded", "arith.extf", "bf16"]]


def test_bf16_arithmetic_is_still_seen_in_any_loop():
    bf16_body = ("      %6 = arith.addf %x, %x : tensor<16x16xbf16> loc(#loc6)\n"
                 "      scf.yield %arg3 : tensor<16x16xf32> loc(#loc5)")
    assert low_precision(_ttir(bf16_body), "/k.py", SOURCE) == [["kernel", "acc = p16 + p16", "computed", "arith.addf", "bf16"]]
