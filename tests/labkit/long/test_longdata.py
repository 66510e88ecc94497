"""labkit.long.data: the stdlib corpus and its windows, loss by position, the passkey task."""
from __future__ import annotations

import pytest
import torch

from labkit.models import gpt2
from labkit.long import data as longdata, levers


# ----------------------------------------------------------------------------- corpus

@pytest.fixture
def text_root(tmp_path):
    for i in range(30):
        (tmp_path / f"mod{i:02d}.py").write_bytes(f"# file {i}\n".encode() * (50 + i))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_bytes(b"x" * 10_000)  # excluded folder
    return tmp_path


def test_corpus_split_by_file_is_deterministic(text_root):
    a = longdata.stdlib_corpus(root=text_root, min_file_bytes=100, val_every=3)
    b = longdata.stdlib_corpus(root=text_root, min_file_bytes=100, val_every=3)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.dtype == torch.uint8 and a.files == 30
    docs = lambda t: set(bytes(t.tolist()).split(bytes([longdata.DOC_SEPARATOR])))  # noqa: E731
    assert not docs(a.train) & docs(a.val), "a document is in both train and val"
    assert len(docs(a.train)) + len(docs(a.val)) == 30 and b"x" * 100 not in bytes(a.train.tolist())


def test_corpus_respects_max_bytes_and_errors(text_root, tmp_path_factory):
    small = longdata.stdlib_corpus(root=text_root, min_file_bytes=100, val_every=3, max_bytes=2000)
    assert small.files < 30
    with pytest.raises(FileNotFoundError, match="min_file_bytes"):
        longdata.stdlib_corpus(root=tmp_path_factory.mktemp("empty"))


def test_stdlib_corpus_is_real_python():
    corpus = longdata.stdlib_corpus(max_bytes=2**20)
    assert corpus.files >= 10 and corpus.val.numel() > 10_000
    assert b"def " in bytes(corpus.train[:200_000].tolist())


def test_windows():
    data = torch.arange(100, dtype=torch.uint8)
    w = longdata.random_windows(data, 4, 10, generator=torch.Generator().manual_seed(0))
    assert w.shape == (4, 10) and w.dtype == torch.int64
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(4, 9, dtype=torch.int64))  # contiguous slices
    e = longdata.eval_windows(data, 10, 5)
    assert torch.equal(e, longdata.eval_windows(data, 10, 5)) and e[0, 0] == 0
    with pytest.raises(ValueError, match="longer than seq_len"):
        longdata.random_windows(data, 1, 100)


def test_loss_by_position_averages_to_the_model_loss():
    model = gpt2.build_model("tiny", n_positions=64).eval()
    ids = torch.randint(0, 256, (6, 40), generator=torch.Generator().manual_seed(0))
    per_pos = longdata.loss_by_position(model, ids, batch_size=4)
    assert per_pos.shape == (39,)
    with torch.no_grad():
        torch.testing.assert_close(per_pos.mean(), levers.lm_loss(model, ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- passkey task

@pytest.mark.parametrize("repeats", [1, 4])
def test_passkey_key_is_far_from_the_question(repeats):
    n, d, k = 40, 20, 5
    ids, answer = longdata.passkey_batch(256, n, min_distance=d, n_keys=k, repeats=repeats, vocab=30,
                                         generator=torch.Generator().manual_seed(0))
    assert ids.shape == (256, n) and answer.shape == (256,)
    assert (ids[:, -1] == k).all() and ((ids[:, :-1] > k) | (ids[:, :-1] == answer[:, None])).all()
    is_key = ids < k
    assert torch.equal(is_key.sum(1), torch.full((256,), repeats))
    last_key = n - 1 - torch.where(is_key, torch.arange(n), -1).amax(1)  # distance of the nearest key
    assert last_key.min() == d, "keys must be >= min_distance back, and the bound should be reached"
    assert len(set(answer.tolist())) == k and ids.max() < 30


def test_passkey_errors():
    with pytest.raises(ValueError, match="min_distance"):
        longdata.passkey_batch(2, 10, min_distance=8, repeats=3)
    with pytest.raises(ValueError, match="vocab"):
        longdata.passkey_batch(2, 10, min_distance=3, n_keys=8, vocab=9)
