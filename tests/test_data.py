import numpy as np
import pytest
import torch

from dtrain.train.data import (
    TokenBatcher,
    byte_tokens,
    load_token_file,
    make_dataset,
    markov_corpus,
    markov_entropy_rate,
    write_token_file,
)
from dtrain.train.data import _markov_chain


def test_markov_corpus_is_deterministic_and_sparse():
    a = markov_corpus(20_000, vocab_size=64, seed=3)
    assert a.dtype == np.uint16 and a.shape == (20_000,) and a.max() < 64
    np.testing.assert_array_equal(a, markov_corpus(20_000, vocab_size=64, seed=3))
    assert not np.array_equal(a, markov_corpus(20_000, vocab_size=64, seed=4))
    # Inside a 4096-token segment every token is one of its context's `branching` successors.
    succ, _ = _markov_chain(64, 3, 1, 4)
    prev, nxt = a[:-1].astype(np.int64), a[1:].astype(np.int64)
    inside = (np.arange(1, len(a)) % 4096) != 0
    assert np.all((succ[prev] == nxt[:, None]).any(axis=1)[inside])
    for ctx in range(64):
        assert len(np.unique(nxt[inside & (prev == ctx)])) <= 4


@pytest.mark.parametrize("order, vocab", [(1, 256), (2, 16)])
def test_entropy_rate_matches_empirical_estimate(order, vocab):
    tokens = markov_corpus(400_000, vocab_size=vocab, seed=1, order=order, branching=4)
    succ, probs = _markov_chain(vocab, 1, order, 4)
    t = tokens.astype(np.int64)
    ctx = t[: len(t) - order] if order == 1 else t[:-2] * vocab + t[1:-1]
    nxt = t[order:]
    p_true = (probs[ctx] * (succ[ctx] == nxt[:, None])).sum(axis=1)
    keep = (np.arange(order, len(t)) % 4096) >= order  # skip the random segment starts
    empirical = -np.log(p_true[keep]).mean()  # Monte-Carlo estimate of the entropy rate
    rate = markov_entropy_rate(vocab, seed=1, order=order, branching=4)
    assert 0.5 < rate < np.log(4)
    assert abs(empirical - rate) < 0.02


def test_entropy_rate_closed_cases():
    assert markov_entropy_rate(32, seed=0, branching=1) == pytest.approx(
        0, abs=1e-12
    )  # deterministic
    # A Dirichlet(1) row over k successors has mean entropy psi(k+1) - psi(2) = 1/2 + ... + 1/k;
    # with many contexts the stationary average is close to it.
    assert abs(markov_entropy_rate(1024, seed=0, branching=4) - (1 / 2 + 1 / 3 + 1 / 4)) < 0.05


def test_markov_validation():
    with pytest.raises(ValueError, match="branching"):
        markov_corpus(10, vocab_size=8, branching=9)
    with pytest.raises(ValueError, match="order"):
        markov_corpus(10, vocab_size=256, order=3)
    with pytest.raises(ValueError, match="uint16"):
        markov_corpus(10, vocab_size=70_000)


def test_token_file_round_trip(tmp_path):
    tokens = np.array([0, 1, 255, 256, 50_256, 65_535], dtype=np.int64)
    path = tmp_path / "train.bin"
    write_token_file(path, tokens)
    assert path.read_bytes() == tokens.astype("<u2").tobytes()  # raw little-endian, no header
    loaded = load_token_file(path)
    assert isinstance(loaded, np.memmap) and loaded.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(loaded, tokens)
    with pytest.raises(ValueError):
        loaded[0] = 1  # read-only
    x, y = TokenBatcher(loaded, seq_len=3, micro_batch=4).next()  # batches straight off the memmap
    for row, target in zip(x.tolist(), y.tolist()):
        start = tokens.tolist().index(row[0])
        assert row + target[-1:] == tokens[start : start + 4].tolist()
    with pytest.raises(ValueError, match="uint16"):
        write_token_file(path, [70_000])


def test_load_token_file_rejects_bad_sizes(tmp_path):
    for name, content in [("empty.bin", b""), ("odd.bin", b"abc")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="uint16 token file"):
            load_token_file(tmp_path / name)


def test_byte_tokens(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes("héllo\n".encode() + bytes([0, 255]))
    np.testing.assert_array_equal(byte_tokens(path), [104, 195, 169, 108, 108, 111, 10, 0, 255])
    assert byte_tokens(path).dtype == np.uint16


def test_make_dataset(tmp_path):
    synthetic = make_dataset("synthetic", num_tokens=1000, seed=2)
    assert synthetic.vocab_size == 256
    np.testing.assert_array_equal(synthetic.tokens, markov_corpus(1000, 256, 2))
    write_token_file(tmp_path / "d.bin", [5, 9, 1000])
    tokens, vocab = make_dataset(str(tmp_path / "d.bin"))
    assert isinstance(tokens, np.memmap) and list(tokens) == [5, 9, 1000] and vocab == 1001
    assert make_dataset(str(tmp_path / "d.bin"), vocab_size=50304).vocab_size == 50304
    (tmp_path / "t.txt").write_text("abc")
    tokens, vocab = make_dataset(str(tmp_path / "t.txt"))
    assert list(tokens) == [97, 98, 99] and vocab == 256
    with pytest.raises(FileNotFoundError, match="neither 'synthetic' nor an existing file"):
        make_dataset(str(tmp_path / "missing.bin"))


CORPUS = np.arange(10_000, dtype=np.uint16)  # token i at position i: windows reveal their start


def test_batches_are_shifted_windows():
    x, y = TokenBatcher(CORPUS, seq_len=8, micro_batch=4).next()
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x, x[:, :1] + torch.arange(8))  # contiguous window
    torch.testing.assert_close(y, x + 1)  # target = next token


def test_batcher_determinism():
    a = TokenBatcher(CORPUS, 8, 4, seed=0)
    b = TokenBatcher(CORPUS, 8, 4, seed=0)
    c = TokenBatcher(CORPUS, 8, 4, seed=1)
    for _ in range(3):
        xa, xb, xc = a.next()[0], b.next()[0], c.next()[0]
        torch.testing.assert_close(xa, xb)
        assert not torch.equal(xa, xc)
    assert not torch.equal(a.get(0)[0], a.get(1)[0])


def test_global_batch_is_independent_of_world_size():
    """64 sequences per step, split as (ranks x micro-steps x micro_batch) in different ways."""

    def step_batch(world_size, grad_accum, step):
        micro = 64 // (world_size * grad_accum)
        parts = [
            TokenBatcher(
                CORPUS, 8, micro, rank=r, world_size=world_size, seed=5, grad_accum=grad_accum
            ).get(step, m)[0]
            for m in range(grad_accum)
            for r in range(world_size)
        ]
        return torch.cat(parts)

    for step in (0, 7):
        reference = step_batch(1, 1, step)
        assert reference.shape == (64, 8)
        for world_size, grad_accum in [(2, 1), (4, 1), (2, 2), (1, 4)]:
            torch.testing.assert_close(step_batch(world_size, grad_accum, step), reference)


def test_next_state_dict_and_resume_on_other_world_size():
    batcher = TokenBatcher(CORPUS, 8, 2, rank=1, world_size=2, grad_accum=2)
    seen = [batcher.next()[0] for _ in range(5)]  # steps 0,0,1,1,2
    torch.testing.assert_close(seen[3], batcher.get(1, 1)[0])
    state = batcher.state_dict()
    assert state["step"] == 2 and state["micro_step"] == 1 and state["global_batch"] == 8

    resumed = TokenBatcher(CORPUS, 8, 2, rank=1, world_size=2, grad_accum=2)
    resumed.load_state_dict(state)
    torch.testing.assert_close(resumed.next()[0], batcher.next()[0])
    # Same global batch on 4 ranks: rank 3 at micro-step 0 holds what rank 1 held at micro-step 1.
    wider = TokenBatcher(CORPUS, 8, 2, rank=3, world_size=4, grad_accum=1)
    wider.load_state_dict({"step": 3, "micro_step": 0, "global_batch": 8})
    torch.testing.assert_close(
        wider.next()[0], TokenBatcher(CORPUS, 8, 2, 1, 2, grad_accum=2).get(3, 1)[0]
    )


def test_batcher_errors():
    with pytest.raises(ValueError, match="need at least seq_len \\+ 1 = 9"):
        TokenBatcher(np.zeros(8, np.uint16), seq_len=8, micro_batch=1)
    with pytest.raises(ValueError, match="rank=2 is outside"):
        TokenBatcher(CORPUS, 8, 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="global_batch=8 but this batcher has global_batch=4"):
        TokenBatcher(CORPUS, 8, 4).load_state_dict({"step": 1, "micro_step": 0, "global_batch": 8})
    with pytest.raises(ValueError, match="micro_step=1 is outside"):
        TokenBatcher(CORPUS, 8, 4).get(0, 1)
    TokenBatcher(np.zeros(9, np.uint16), seq_len=8, micro_batch=1).next()  # exactly enough
