"""Token data without downloads: a synthetic Markov corpus, byte-level files, nanoGPT .bin files,
and a batcher whose batches do not depend on the world size.

Why the Markov corpus: a sparse random chain has structure a model can learn and a known loss
floor (`markov_entropy_rate`), so a loss curve on it means something without any dataset.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

_SEGMENT = 4096  # markov_corpus generates independent segments of this many tokens in parallel
_MAX_CONTEXTS = 1 << 20


# --- synthetic corpus ------------------------------------------------------------------------


def _de_bruijn(k: int, n: int) -> list[int]:
    """A cyclic sequence over k symbols that contains every length-n word exactly once (FKM)."""
    seq: list[int] = []
    a = [0] * (k * n)

    def visit(t: int, p: int) -> None:
        if t > n:
            if n % p == 0:
                seq.extend(a[1 : p + 1])
            return
        a[t] = a[t - p]
        visit(t + 1, p)
        for j in range(a[t - p] + 1, k):
            a[t] = j
            visit(t + 1, t)

    visit(1, 1)
    return seq


def _markov_chain(vocab_size: int, seed: int, order: int, branching: int):
    """Successor tokens and their probabilities for each context, both (vocab**order, branching).

    A context is the last `order` tokens read as a base-`vocab_size` number. Successor 0 follows a
    de Bruijn cycle through all contexts (alphabet shuffled by seed), which makes the chain
    irreducible, so it has one stationary distribution; the others are distinct random tokens."""
    if not 1 <= vocab_size <= 65536:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 65536] (tokens are uint16)")
    if not 1 <= branching <= vocab_size:
        raise ValueError(f"branching={branching} must be in [1, vocab_size={vocab_size}]")
    n_ctx = vocab_size**order
    if order < 1 or n_ctx > _MAX_CONTEXTS:
        raise ValueError(f"order={order} must be >= 1 with vocab_size**order <= {_MAX_CONTEXTS}")
    rng = np.random.default_rng(seed)
    alphabet = rng.permutation(vocab_size)
    cycle = alphabet[_de_bruijn(vocab_size, order)]
    ctx = np.zeros(n_ctx, dtype=np.int64)  # context ending just before position i of the cycle
    for j in range(order, 0, -1):  # oldest token is the most significant digit
        ctx = ctx * vocab_size + np.roll(cycle, j)
    succ = np.empty((n_ctx, branching), dtype=np.int64)
    succ[ctx, 0] = cycle
    # Distinct offsets from the cycle successor: cumulative sums of gaps >= 1 that stay below vocab.
    max_gap = (vocab_size - 1) // max(branching - 1, 1)
    gaps = rng.integers(1, max_gap + 1, size=(n_ctx, branching - 1))
    succ[:, 1:] = (succ[:, :1] + np.cumsum(gaps, axis=1)) % vocab_size
    probs = rng.dirichlet(np.ones(branching), size=n_ctx)
    return succ, probs


def markov_corpus(
    num_tokens: int, vocab_size: int = 256, seed: int = 0, *, order: int = 1, branching: int = 4
) -> np.ndarray:
    """`num_tokens` uint16 tokens from a sparse random Markov chain fixed by `seed`: each context
    (last `order` tokens) is followed by one of `branching` tokens with Dirichlet(1) weights.

    For speed the corpus is a concatenation of independent 4096-token segments (like documents),
    each started from `order` uniformly random tokens; those starts add < 0.1% to the loss floor."""
    succ, probs = _markov_chain(vocab_size, seed, order, branching)
    cum = np.cumsum(probs, axis=1)
    rng = np.random.default_rng((seed, 1))
    n_seg = max(1, -(-num_tokens // _SEGMENT))
    seg_len = min(num_tokens, _SEGMENT)
    out = np.empty((n_seg, max(seg_len, order)), dtype=np.uint16)
    out[:, :order] = rng.integers(0, vocab_size, size=(n_seg, order))
    ctx = np.zeros(n_seg, dtype=np.int64)
    for j in range(order):
        ctx = ctx * vocab_size + out[:, j]
    for t in range(order, seg_len):  # one step of every segment at once
        pick = (rng.random(n_seg)[:, None] > cum[ctx]).sum(axis=1).clip(max=branching - 1)
        tok = succ[ctx, pick]
        out[:, t] = tok
        ctx = (ctx * vocab_size + tok) % vocab_size**order
    return out.reshape(-1)[:num_tokens]


def markov_entropy_rate(
    vocab_size: int = 256, seed: int = 0, *, order: int = 1, branching: int = 4
) -> float:
    """Entropy rate of the chain behind `markov_corpus(..., vocab_size, seed, order=, branching=)`
    in nats per token: the cross-entropy loss a perfect model reaches on it."""
    succ, probs = _markov_chain(vocab_size, seed, order, branching)
    n_ctx = succ.shape[0]
    nxt = (np.arange(n_ctx)[:, None] * vocab_size + succ) % n_ctx  # context after each successor
    # Power iteration on the lazy chain (P + I) / 2: same stationary distribution, and it
    # converges even if the chain is periodic.
    pi = np.full(n_ctx, 1.0 / n_ctx)
    for _ in range(100_000):
        new = 0.5 * pi + 0.5 * np.bincount(nxt.ravel(), (pi[:, None] * probs).ravel(), n_ctx)
        done = np.abs(new - pi).sum() < 1e-13
        pi = new
        if done:
            break
    row_entropy = -(probs * np.log(probs, where=probs > 0, out=np.zeros_like(probs))).sum(axis=1)
    return float(pi @ row_entropy)


# --- files -----------------------------------------------------------------------------------


def byte_tokens(path: str | os.PathLike) -> np.ndarray:
    """Byte-level tokens (vocab 256) of any file, as uint16."""
    return np.fromfile(path, dtype=np.uint8).astype(np.uint16)


def load_token_file(path: str | os.PathLike) -> np.memmap:
    """A nanoGPT .bin file (raw little-endian uint16 token ids, no header), memmapped read-only."""
    size = os.path.getsize(path)
    if size == 0 or size % 2:
        raise ValueError(f"{path}: {size} bytes is not a non-empty uint16 token file")
    return np.memmap(path, dtype="<u2", mode="r")


def write_token_file(path: str | os.PathLike, tokens) -> None:
    """Write tokens in nanoGPT .bin format (atomically: a reader never sees half a file)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > 65535):
        raise ValueError(
            f"token ids must be in [0, 65535] to fit uint16, got [{tokens.min()}, {tokens.max()}]"
        )
    tmp = Path(f"{path}.tmp")
    tokens.astype("<u2").tofile(tmp)
    os.replace(tmp, path)


class Dataset(NamedTuple):
    tokens: np.ndarray
    vocab_size: int


def make_dataset(
    source: str, *, num_tokens: int = 1_000_000, vocab_size: int | None = None, seed: int = 0
) -> Dataset:
    """``"synthetic"`` -> markov_corpus(num_tokens, vocab_size or 256, seed);
    ``*.bin`` -> memmapped uint16 tokens (vocab_size, if not given, is max token + 1: one scan);
    any other file -> its bytes (vocab 256). `num_tokens` and `seed` apply to "synthetic" only."""
    if source == "synthetic":
        vocab_size = vocab_size or 256
        return Dataset(markov_corpus(num_tokens, vocab_size, seed), vocab_size)
    if not os.path.isfile(source):
        raise FileNotFoundError(
            f"data source {source!r} is neither 'synthetic' nor an existing file"
        )
    if source.endswith(".bin"):
        tokens = load_token_file(source)
        return Dataset(tokens, vocab_size or int(tokens.max()) + 1)
    return Dataset(byte_tokens(source), 256)


# --- batches ---------------------------------------------------------------------------------


class TokenBatcher:
    """Random windows of `seq_len + 1` tokens, sharded across ranks so that the data seen at each
    optimizer step depends only on (seed, step, global batch), never on how it is split.

    At step s the whole step's batch, ``micro_batch * world_size * grad_accum`` window starts, is
    drawn from ``default_rng((seed, s))``; micro-step m of rank r takes the contiguous slice number
    ``m * world_size + r``. A run resumed on 2 ranks instead of 4 (same global batch) therefore
    trains on the same samples at every step. Windows are drawn with replacement (no epochs).
    """

    def __init__(
        self,
        tokens,
        seq_len: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        grad_accum: int = 1,
    ):
        if min(seq_len, micro_batch, world_size, grad_accum) < 1:
            raise ValueError("seq_len, micro_batch, world_size and grad_accum must all be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"corpus has {len(tokens)} tokens; need at least seq_len + 1 = "
                f"{seq_len + 1} for one (input, target) window"
            )
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.rank, self.world_size, self.seed, self.grad_accum = rank, world_size, seed, grad_accum
        self.step = 0
        self.micro_step = 0

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over all ranks and micro-steps."""
        return self.micro_batch * self.world_size * self.grad_accum

    def get(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) at a data position, int64 (micro_batch, seq_len), y = x shifted by
        one."""
        if not 0 <= micro_step < self.grad_accum:
            raise ValueError(
                f"micro_step={micro_step} is outside [0, grad_accum={self.grad_accum})"
            )
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)
        first = (micro_step * self.world_size + self.rank) * self.micro_batch
        mine = starts[first : first + self.micro_batch]
        windows = self.tokens[mine[:, None] + np.arange(self.seq_len + 1)]  # works on memmaps
        windows = torch.from_numpy(np.asarray(windows, dtype=np.int64))
        return windows[:, :-1], windows[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the current position, then advance one micro-step (and step)."""
        batch = self.get(self.step, self.micro_step)
        self.micro_step += 1
        if self.micro_step == self.grad_accum:
            self.step, self.micro_step = self.step + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "micro_step": self.micro_step,
            "seed": self.seed,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position. Seed and global batch, if present, must match: otherwise the
        resumed run would silently see other data (drop those keys to change them on purpose)."""
        for key in ("seed", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                fix = {
                    # fewer ranks: keep the batch, grad_accum grows
                    "seed": f"pass seed={state[key]}",
                    "global_batch": (
                        f"pass train.global_batch={state[key]} to keep the checkpoint's batch"
                    ),
                }[key]
                raise ValueError(
                    f"data state has {key}={state[key]} but this batcher has "
                    f"{key}={getattr(self, key)}; resuming would change the data: {fix}"
                )
        self.step, self.micro_step = int(state["step"]), int(state["micro_step"])
