"""labkit.determinism.bench: the verdicts from ratio tables (PASS, MISS, not measured); run_to_run counts distinct bits;
the GPU sweeps themselves run on a GPU only."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from labkit.determinism import bench


def test_verdicts_take_the_worst_ratio():
    decode = pd.DataFrame({"batch": [1, 8, 64], "fixed_over_dynamic": [3.0, 1.05, 1.2], "fixed_over_unsplit": [0.2, 0.1, 0.1]})
    backward = pd.DataFrame({"det_over_atomic": [1.1, 1.15]})
    v = bench.verdicts(decode, backward).set_index("goal")
    assert v.loc["fixed split vs dynamic split, batch >= 8", "worst_ratio"] == 1.2
    assert v.verdict.tolist() == ["MISS", "PASS", "PASS"]
    empty = bench.verdicts(pd.DataFrame({"batch": [8], "note": ["skipped"]}), pd.DataFrame({"note": ["skipped"]}))
    assert (empty.verdict == "not measured").all()


def test_run_to_run_counts_distinct_bits():
    values = iter([torch.tensor(1.0), torch.tensor(1.0), torch.tensor(2.0)])
    assert bench.run_to_run(lambda: next(values), 3) == 2


@pytest.mark.gpu
def test_decode_and_backward_sweeps_on_a_gpu():
    from labkit.determinism import decode
    fixed = lambda q, k, v, lens: decode.combine(*decode.split_partials(q, k, v, lens, 512, -(-int(lens.max()) // 512)), q.dtype)  # noqa: E731
    table = bench.decode_sweep(fixed, batches=(1, 8), lengths=(8192,))
    assert table.fixed_ms.gt(0).all() and table.fixed_over_dynamic.notna().all()
    grads = bench.backward_sweep(lambda *a, **kw: bench.detbackward.atomic_backward(*a, **kw), lengths=(4096,))
    assert grads.det_over_atomic.notna().all()
