"""What the speed-of-light board checks and times, per assignment (``python -m labkit board``): :data:`SPECS`.

Each :class:`Spec` (:mod:`labkit.board.common`) names the graded functions a notebook must define and gives its
steps, each run in the student's own process (:mod:`labkit.board.worker`) on the namespace the notebook's cells built:

- ``own``: label -> function whose code :func:`labkit.core.grading.check_own_code` checks (no labkit, no library
  attention or softmax; ``allow``: the labkit modules the exercise gives, 10's ``lk.fp8cast``) and whose call must
  launch Triton kernels defined in the notebook (``calls``: tiny calls);
- ``audit(ns, device)`` (10 only): why the kernels are not what the assignment asks although they may be right
  (10: no FP8 MMA in the sm90 compile), a ``flagged`` reason, or None;
- ``check(ns, seed, device)``: the graded functions on fresh inputs drawn from the board's secret seed, at
  shapes the visible tests never use (uneven lengths, N not a multiple of the block, N != Nk, GQA with a
  group of 3, masks and a sink); raises AssertionError (-> ``wrong``). fp32 inputs: an absolute tolerance against
  float64; bf16 (GPU): the course's 2x rule (:func:`labkit.core.grading.check_within_2x`); e4m3 (10): notebook
  10's bound against float64 attention of the dequantized inputs;
- ``time(ns, seed, device, target_ms)``: GPU only. The student's calls beside the library kernels, the notebook's
  timers; then the timed tensors rewritten in place and the calls checked again (a cached output fails).

One module per assignment: :mod:`labkit.board.nb06` (FlashAttention forward and backward; TFLOP/s over the
matmul peak), :mod:`labkit.board.nb08` (decode, split-KV and paged; GB/s over the read ceiling),
:mod:`labkit.board.nb09` (block-sparse forward with a sink and backward; TFLOP/s of the kept work over the
matmul peak, beside compiled flex_attention), :mod:`labkit.board.nb10` (the FP8 forward; the sm90 compile must
show FP8 MMA for both dots; TFLOP/s over the measured FP8 GEMM ceiling).

Used by: :mod:`labkit.board.worker`, :mod:`labkit.board.rank`.
"""
from __future__ import annotations

from labkit.board import nb06 as boardshapes06, nb08 as boardshapes08, nb09 as boardshapes09, nb10 as boardshapes10
from labkit.board.common import CHECK_DTYPES, PEAK_N, Spec, forbidden, geomean
from labkit.board.nb06 import attention_exact
from labkit.board.nb08 import decode_exact, paged_copy, to_pages

__all__ = ["CHECK_DTYPES", "PEAK_N", "SPECS", "Spec", "attention_exact", "decode_exact", "forbidden", "geomean",
           "paged_copy", "to_pages"]
SPECS: dict[str, Spec] = {
    "06_triton_flashattention": boardshapes06.SPEC,
    "08_decode_attention": boardshapes08.SPEC,
    "09_flex_attention": boardshapes09.SPEC,
    "10_fp8_attention": boardshapes10.SPEC,
}
