"""Visible tests of 04_performance_analysis's exercises: FLOP and byte counts, the roofline, the time predictor.

The expected counts are worked out by hand from the notebook's tables (whole numbers); the fit is compared with
the least relative squared error reachable, computed another way (a QR projection in float64).

Used in: 04_performance_analysis (test cells of ex1, ex2, ex3, ex4)
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from labkit.core import grading

PHASE_FLOP_HINT = "矩陣乘法 (N×d)(d×N) 是 2·N·N·d FLOP（每次乘加算 2 個）；softmax 每個分數元素 5 FLOP；最後乘上 B·H。"
PHASE_BYTES_HINT = ("每個階段 = 讀進來的張量 + 寫出去的張量（QK^T：讀 Q、K，寫 S；softmax：讀 S，寫 P；PV：讀 P、V，寫 O），"
                    "元素數 × elem_bytes × B·H；elem_bytes 用傳進來的值，不要寫死 2（bf16）。")
PHASE_CASES = {  # worked out by hand from the table: (B, H, N, D, elem_bytes), phase -> (flop, bytes)
    "B=2, H=4, N=256, d=64, bf16": ((2, 4, 256, 64, 2), {"QK^T": (67_108_864, 1_572_864), "softmax": (2_621_440, 2_097_152),
                                                        "PV": (67_108_864, 1_572_864)}),
    "B=4, H=2, N=96, d=32, fp32": ((4, 2, 96, 32, 4), {"QK^T": (4_718_592, 491_520), "softmax": (368_640, 589_824),
                                                      "PV": (4_718_592, 491_520)}),
}


def phase_counts_by_hand(standard_phase_counts) -> None:
    """A dict "QK^T", "softmax", "PV" -> (flop, bytes) equal to the hand counts of :data:`PHASE_CASES`; no labkit."""
    for label, ((B, H, N, D, s), expected) in PHASE_CASES.items():
        counts = standard_phase_counts(B, H, N, D, elem_bytes=s)
        grading.check_true(isinstance(counts, dict) and set(counts) == {"QK^T", "softmax", "PV"},
                           name="回傳 'QK^T'、'softmax'、'PV' 三個鍵的 dict", detail=f"卻得到 {counts!r:.120}")
        grading.check_true(all(isinstance(v, (tuple, list)) and len(v) == 2 for v in counts.values()),
                           name="每個階段的值是 (flop, bytes)", detail=f"卻得到 {counts!r:.160}")
        for phase, (ref_flop, ref_bytes) in expected.items():
            flop, nbytes = counts[phase]
            grading.check_scalar(flop, ref_flop, name=f"{phase} 的 FLOP：矩陣乘法 2·N²·d、softmax 5·N²，乘 B·H（{label}）",
                                 hint=PHASE_FLOP_HINT)
            grading.check_scalar(nbytes, ref_bytes, name=f"{phase} 的位元組：每個讀寫的張量 × elem_bytes × B·H（{label}）",
                                 hint=PHASE_BYTES_HINT)
    grading.check_own_code(standard_phase_counts, name="standard_phase_counts 不可呼叫 labkit")


def flash_bytes_by_hand(flash_forward_bytes) -> None:
    """s·(2Nd + 2Nd·T_r) + 4N per head, times B·H, with T_r = ceil(N / block_m): three sizes worked out by hand
    (T_r = 2; N = 200 not a multiple of block_m = 64 in fp32; N = 384, an odd multiple of 128); no labkit."""
    grading.check_scalar(flash_forward_bytes(2, 4, 256, 64, elem_bytes=2, block_m=128), 1_581_056,
                         name="flash_forward_bytes 依公式，LSE 以 fp32 計（B=2, H=4, N=256, d=64, bf16, block_m=128 → T_r=2）",
                         hint=("讀 Q、寫 O：2·N·d；每個 Q 區塊各讀一次 K 與 V：2·N·d·T_r；這些元素乘 elem_bytes。"
                               "log-sum-exp 一律 fp32：4·N（不乘 elem_bytes）。全部乘 B·H。"))
    # N not a multiple of block_m: T_r = ceil(200 / 64) = 4, the last tile holds 8 rows; fp32 elements
    grading.check_scalar(flash_forward_bytes(1, 2, 200, 32, elem_bytes=4, block_m=64), 513_600,
                         name="T_r 無條件進位：N 不是 block_m 的倍數（B=1, H=2, N=200, d=32, fp32, block_m=64 → T_r=4）",
                         hint="T_r = ceil(N / block_m)：最後一個不滿的區塊也要讀一次 K、V，N // block_m 會少算一塊；"
                              "elem_bytes 與 block_m 都要用傳進來的值。")
    grading.check_own_code(flash_forward_bytes, name="flash_forward_bytes 不可呼叫 labkit")
    grading.check_scalar(flash_forward_bytes(1, 1, 384, 32, elem_bytes=2, block_m=128), 198_144,
                         name="T_r：N 剛好是 block_m 的奇數倍時不多算一塊（B=1, H=1, N=384, d=32, bf16, block_m=128 → T_r=3）",
                         hint="T_r = math.ceil(N / block_m)；round(N / block_m + 0.5) 在商是奇數時會多一塊（round 取偶數）。")


def intensity_rules(arithmetic_intensity, flash_forward_bytes) -> None:
    """flop / nbytes (true division, flop = 0 gives 0), ValueError for nbytes 0 and -8, and FlashAttention's
    intensity above standard attention's at B=2, H=4, N=256, d=64 (the three phases of exercise 1 summed); no labkit."""
    grading.check_scalar(arithmetic_intensity(10, 4), 2.5, name="arithmetic_intensity = flop / nbytes", hint="用 / 而不是 //。")
    grading.check_scalar(arithmetic_intensity(0, 4), 0.0, name="arithmetic_intensity：flop = 0（例如純複製）的強度是 0，不是錯誤",
                         hint="只有 nbytes <= 0 要拋出 ValueError；flop 為 0 是合法的輸入。")
    for bad in (0, -8):
        grading.check_raises(lambda: arithmetic_intensity(10, bad), ValueError,
                             name=f"arithmetic_intensity：nbytes <= 0 要拋出 ValueError（nbytes={bad}）",
                             hint="相除之前先檢查 if nbytes <= 0: raise ValueError(...)；0 會變成 ZeroDivisionError，"
                                  "負數則會回傳沒有意義的負強度。")
    flop, std_bytes = 136_839_168, 5_242_880
    grading.check_true(arithmetic_intensity(flop, flash_forward_bytes(2, 4, 256, 64)) > arithmetic_intensity(flop, std_bytes),
                       name="FlashAttention 的算術強度高於標準注意力", detail="同樣的 FLOP，FlashAttention 搬的位元組較少，算術強度應該比較高。")
    grading.check_own_code(arithmetic_intensity, name="arithmetic_intensity 不可呼叫 labkit")


ROOF_TYPE_HINT = ("用 numpy 計算並回傳 numpy 陣列：np.minimum(peak_tflops, np.asarray(intensity, dtype=float) * bandwidth / 1e12)；"
                  "torch 張量與 pandas Series 比較大小會拋出 TypeError（第 4 節屋頂線那一格就這麼用），list 也不能逐元素運算。")


def roofline_values(attainable_tflops) -> None:
    """min(peak, I·bandwidth/1e12) in TFLOP/s on a toy machine (100 TFLOP/s, 1 TB/s: ridge at 100 FLOP/byte) for
    a number (a numpy scalar back), a numpy array and a pandas Series of 4 intensities (a numpy array back), on a
    50 TFLOP/s, 2 TB/s machine, and for I = 2.5; no labkit."""
    one = attainable_tflops(10.0, 100.0, 1e12)
    grading.check_true(not isinstance(one, (torch.Tensor, list, tuple)) and np.ndim(one) == 0,
                       name="attainable_tflops 回傳 numpy 的數或陣列，不是 torch 張量（數字輸入）",
                       detail=f"輸入一個數字，應回傳一個數（float 或 numpy 純量），卻得到 {type(one).__name__} {one!r:.80}", hint=ROOF_TYPE_HINT)
    grading.check_scalar(float(attainable_tflops(10.0, 100.0, 1e12)), 10.0,
                         name="attainable_tflops 記憶體那一側：intensity × bandwidth，換成 TFLOP/s",
                         hint="屋頂 = min(peak_tflops, intensity × bandwidth / 1e12)；intensity（FLOP/byte）× bandwidth（bytes/s）= FLOP/s，"
                              "除以 1e12 換成 TFLOP/s。")
    grading.check_scalar(float(attainable_tflops(1000.0, 100.0, 1e12)), 100.0, name="attainable_tflops 算力那一側：不超過 peak_tflops",
                         hint="屋頂線取兩者中較小的：min(peak_tflops, intensity × bandwidth / 1e12)。")
    xs = np.array([2.0, 50.0, 100.0, 250.0])
    for kind, arg in (("numpy 陣列", xs), ("pandas Series", pd.Series(xs, name="intensity"))):
        try:
            got = attainable_tflops(arg, 100.0, 1e12)
        except Exception as err:  # noqa: BLE001 - e.g. Python's min() on an array
            got = err
        grading.check_true(isinstance(got, (np.ndarray, pd.Series, Exception)),
                           name=f"attainable_tflops 回傳 numpy 陣列，不是 torch 張量或 list（{kind}）",
                           detail=f"輸入長度 4 的 {kind}，應回傳 numpy 陣列，卻得到 {type(got).__name__}", hint=ROOF_TYPE_HINT)
        grading.check_true(not isinstance(got, Exception) and np.shape(got) == xs.shape,
                           name=f"attainable_tflops 逐元素計算（{kind}）",
                           detail=f"輸入長度 4 的 {kind}，應回傳長度 4 的結果，卻得到 {got!r:.120}",
                           hint="Python 的 min() 只能比較兩個數字，遇到陣列會出錯；用 np.minimum 逐元素取較小值"
                                "（第 4 節的表格會傳入 io['intensity'] 這個 Series）。")
        grading.check_tensor(torch.as_tensor(np.asarray(got, dtype=float)), torch.tensor([2.0, 50.0, 100.0, 100.0], dtype=torch.float64),
                             name=f"attainable_tflops 逐元素計算（{kind}）", atol=1e-9,
                             hint="每個元素都是 min(peak_tflops, intensity × bandwidth / 1e12)。")
    # a second machine, 50 TFLOP/s and 2 TB/s (ridge 25 FLOP/byte): the bandwidth multiplies the intensity before the min
    got = np.asarray(attainable_tflops(np.array([10.0, 40.0]), 50.0, 2e12), dtype=float)
    grading.check_tensor(torch.as_tensor(got.copy()), torch.tensor([20.0, 50.0], dtype=torch.float64),
                         name="attainable_tflops：50 TFLOP/s、2 TB/s 的機器（I = 10、40 FLOP/byte）", atol=1e-9,
                         hint="先乘頻寬再取較小值：min(peak_tflops, intensity × bandwidth / 1e12)；"
                              "min(intensity, peak) × bandwidth 只在 1 TB/s 的機器上碰巧相同。")
    grading.check_own_code(attainable_tflops, name="attainable_tflops 不可呼叫 labkit")
    got = attainable_tflops(pd.Series(xs, index=[7, 3, 12, 5]), 100.0, 1e12)
    grading.check_true(isinstance(got, np.ndarray), name="attainable_tflops 回傳 numpy 陣列（pandas Series 輸入）",
                       detail=f"輸入 pandas Series，應回傳 numpy 陣列，卻得到 {type(got).__name__}。", hint=ROOF_TYPE_HINT)
    grading.check_scalar(float(attainable_tflops(2.5, 100.0, 1e12)), 2.5, name="attainable_tflops：強度不是整數（I = 2.5 FLOP/byte）",
                         hint="用 np.asarray(intensity, dtype=float)，不要轉成整數。")


def ridge_point(memory_or_compute) -> None:
    """'memory' below the ridge peak·1e12/bandwidth, 'compute' at and above it: the toy machine (ridge 100) and a
    30 TFLOP/s, 1.5 TB/s one (ridge 20); no labkit."""
    for intensity, want in ((10.0, "memory"), (1000.0, "compute"), (100.0, "compute")):
        got = memory_or_compute(intensity, 100.0, 1e12)
        grading.check_true(got == want, name="memory_or_compute：平衡點 peak / bandwidth 左邊是 'memory'，平衡點上與右邊是 'compute'",
                           detail=f"I={intensity:g} FLOP/byte，平衡點 100 FLOP/byte，應回傳 {want!r}，卻得到 {got!r}。",
                           hint="平衡點 = peak_tflops × 1e12 / bandwidth（FLOP/s ÷ bytes/s）；intensity < 平衡點 才是 'memory'，"
                                "剛好等於時算 'compute'。")
    grading.check_own_code(memory_or_compute, name="memory_or_compute 不可呼叫 labkit")
    for intensity, want in ((19.9, "memory"), (20.0, "compute")):
        got = memory_or_compute(intensity, 30.0, 1.5e12)
        grading.check_true(got == want, name=f"memory_or_compute：30 TFLOP/s、1.5 TB/s 的機器，I = {intensity:g}（平衡點 20 FLOP/byte）",
                           detail=f"平衡點 30e12 / 1.5e12 = 20 FLOP/byte，應回傳 {want!r}，卻得到 {got!r}。",
                           hint="平衡點 = peak_tflops × 1e12 / bandwidth；只在 1 TB/s 的機器上它碰巧等於 peak_tflops。")


def _frame(**axes) -> pd.DataFrame:
    """One row per combination of the values in `axes` (column -> values), in the order given."""
    return pd.MultiIndex.from_product(list(axes.values()), names=list(axes)).to_frame(index=False)


def _matrix(design_matrix, df) -> torch.Tensor:
    """design_matrix(df) as a float64 tensor [rows, 4]."""
    return torch.as_tensor(np.asarray(design_matrix(df), dtype=float))


def _unchanged(name: str, which: str, before, after) -> None:
    """``after`` (a DataFrame or numpy array the answer was handed) equals the copy ``before`` taken before the call."""
    same = before.equals(after) if isinstance(before, pd.DataFrame) else np.array_equal(before, after)
    grading.check_true(same, name=f"{name}：不修改輸入（{which}）", detail=f"呼叫之後，傳入的 {which} 被改了"
                       + (f"：欄位從 {list(before.columns)} 變成 {list(after.columns)}。" if isinstance(before, pd.DataFrame) else "。"),
                       hint="不要在呼叫端的 df 上新增或改寫欄位（df['c'] = ...），也不要原地運算（X /= ...、y *= ...）；"
                            "用區域變數，或先 .copy()。")


def design_matrix_columns(design_matrix) -> None:
    """[rows, 4] = 4BHN²d·c, BHN²·c, BHNd, 1 (c = 0.5 when causal) for a non-causal and a causal row, and a
    GPU-sized row (4BHN²d ~ 3.5e13) without int32 overflow; the caller's df left as it was (no column added); no labkit."""
    tiny = pd.DataFrame([dict(B=2, H=3, N=6, D=5, causal=False), dict(B=2, H=3, N=6, D=5, causal=True)])
    before = tiny.copy()
    matrix = _matrix(design_matrix, tiny)
    _unchanged("design_matrix", "df", before, tiny)
    grading.check_tensor(matrix, torch.tensor([[4320.0, 216, 180, 1], [2160, 108, 180, 1]], dtype=torch.float64),
                         name="design_matrix：[列數, 4]，欄位 4BHN²d·c、BHN²·c、BHNd、1（causal 時 c = 0.5）", atol=1e-9,
                         hint="causal 時前兩欄乘 0.5；第三欄 B·H·N·D 不變；最後一欄是 1。")
    grading.check_own_code(design_matrix, name="design_matrix 不可呼叫 labkit")
    big = pd.DataFrame([dict(B=32, H=32, N=8192, D=128, causal=False)])   # a GPU-sized row: 4BHN²d ≈ 3.5e13
    grading.check_tensor(_matrix(design_matrix, big),
                         torch.tensor([[35_184_372_088_832.0, 68_719_476_736, 1_073_741_824, 1]], dtype=torch.float64),
                         name="design_matrix：GPU 大小的設定不溢位（B=32, H=32, N=8192, d=128）", atol=0, rtol=1e-12,
                         hint="用 to_numpy(dtype=float)；int32（Windows 上 numpy 1.x 的 dtype=int 就是它）在 4BHN²d 超過 2³¹ 時悄悄溢位。")


def fit_least_relative_error(design_matrix, fit_time_model) -> None:
    """On 16 configurations without noise the fit reproduces y and the coefficients; on 96 noisy ones spanning three
    decades (0.02 ms to 50 ms) it reaches the least relative squared error sum(((X θ - y) / y)²); X and y left
    unchanged (no X /= y in place); no labkit."""
    toy = _frame(B=(1, 2), H=(2, 4), N=(64, 256), D=(16, 32), causal=(False,))
    X_toy = _matrix(design_matrix, toy).numpy()
    true_coef = np.array([2e-10, 3e-7, 1e-8, 0.02])
    y_toy = X_toy @ true_coef
    X_before, y_before = X_toy.copy(), y_toy.copy()
    coef = np.asarray(fit_time_model(X_toy, y_toy), dtype=float)
    _unchanged("fit_time_model", "X", X_before, X_toy)
    _unchanged("fit_time_model", "y", y_before, y_toy)
    grading.check_tensor(torch.as_tensor(X_toy @ coef), torch.as_tensor(y_toy), name="fit_time_model：沒有雜訊的資料要完全擬合",
                         atol=0, rtol=1e-6,
                         hint="沒有雜訊的資料，擬合後的預測應與 y 完全一致；每一欄除以範數解完後，係數也要除以同一個範數換回來。")
    grading.check_tensor(torch.as_tensor(coef), torch.as_tensor(true_coef), name="fit_time_model：還原真正的係數（沒有雜訊）",
                         atol=0, rtol=1e-3, hint="每一欄除以範數解完之後，係數也要除以同一個範數換回原本的單位。")
    wide = _frame(B=(1, 4), H=(2, 8), N=(32, 256, 2048), D=(32, 64), causal=(False, True))
    X_wide = _matrix(design_matrix, wide).numpy()
    y_wide = (X_wide @ true_coef) * np.exp(0.1 * np.random.default_rng(0).standard_normal(len(wide)))
    coef_wide = np.asarray(fit_time_model(X_wide, y_wide), dtype=float)
    rel_sse = float(np.sum(((X_wide @ coef_wide - y_wide) / y_wide) ** 2))
    A_wide = torch.as_tensor(X_wide / y_wide[:, None])
    Q_wide = torch.linalg.qr(A_wide / A_wide.norm(dim=0))[0]
    ones = torch.ones(len(wide), dtype=torch.float64)
    best_sse = float((ones - Q_wide @ (Q_wide.T @ ones)).square().sum())  # the smallest reachable: 1 minus its projection
    grading.check_true(rel_sse <= best_sse * (1 + 1e-6), name="fit_time_model 最小化相對誤差（有雜訊、跨三個數量級的資料）",
                       detail=f"Σ((Xθ − y)/y)² = {rel_sse:.4g}，最小可達 {best_sse:.4g}。",
                       hint="每一列（X 與 y）都先除以 y，目標值全是 1，再做最小平方；np.linalg.lstsq(X, y) 最小化的是絕對誤差，"
                            "讓最慢（約 50 ms）的設定主導，快的設定相對誤差可達好幾倍。")
    grading.check_own_code(fit_time_model, name="fit_time_model 不可呼叫 labkit")


def mape_rules(mape) -> None:
    """100 · mean(|pred − true| / |true|) for lists, Series, negative values, three values (mean, not median), and a
    numpy prediction against a Series indexed 7, 3, 12 (no index alignment); no labkit."""
    hint = "MAPE = 100 × mean(|pred − true| / |true|)，單位是百分比；先用 np.asarray 把 list、Series 轉成陣列。"
    for label, pred, true, want in (("list", [110.0, 90.0], [100.0, 100.0], 10.0),
                                    ("pandas Series", pd.Series([3.0, 6.0]), pd.Series([4.0, 5.0]), 22.5),
                                    ("true 為負數時分母用 |true|", np.array([-90.0, -130.0]), np.array([-100.0, -100.0]), 20.0),
                                    ("三個值：平均，不是中位數", np.array([105.0, 70.0, 100.0]), np.array([100.0, 100.0, 100.0]), 35.0 / 3)):
        try:
            got = mape(pred, true)
        except Exception as err:  # noqa: BLE001 - e.g. list - list
            got = err
        grading.check_true(not isinstance(got, Exception), name=f"mape（{label}）", detail=f"呼叫時拋出 {got!r:.120}", hint=hint)
        grading.check_scalar(got, want, name=f"mape：百分比，分母 |true|（{label}）", hint=hint)
    # The predictor cell passes a numpy prediction and a column of a filtered DataFrame (its index is not 0, 1, 2):
    # pandas aligns Series by index, so a conversion that keeps the index compares the wrong rows (or none).
    got = mape(np.array([110.0, 45.0, 300.0]), pd.Series([100.0, 50.0, 200.0], index=[7, 3, 12]))
    grading.check_scalar(got, 70.0 / 3, name="mape：numpy 陣列的預測 vs 索引不是 0, 1, 2 的 pandas Series",
                         hint="用 np.asarray 把兩者都轉成陣列再逐元素計算：pandas 的 Series 依索引對齊，"
                              "pd.Series(pred) - true 會把不同列配在一起（或得到 NaN）。")
    grading.check_own_code(mape, name="mape 不可呼叫 labkit")
