import math

import pytest
import torch
import torch.nn as nn

from dtrain.train.data import TokenBatcher, markov_corpus
from dtrain.model.gpt import GPT, PRESETS, GPTConfig, flops_per_token, num_matmul_params, num_params

TINY = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # MHA, RMSNorm, untied, no bias
        {"n_kv_head": 2},  # GQA
        {"n_kv_head": 1, "tie_embeddings": True},  # MQA + tied
        {"norm": "layernorm", "bias": True},  # GPT-2 style
        {"norm": "layernorm", "bias": False, "mlp_ratio": 2},
    ],
)
def test_num_params_matches_built_model(overrides):
    cfg = GPTConfig(**{**TINY, **overrides})
    model = GPT(cfg)
    assert num_params(cfg) == count(model)
    embeddings = model.pos_emb.weight.numel() + (
        0 if cfg.tie_embeddings else model.tok_emb.weight.numel()
    )
    assert num_params(cfg, exclude_embeddings=True) == count(model) - embeddings
    linear_weights = sum(model.get_submodule(n).weight.numel() for n in GPT.linear_names(cfg))
    assert num_matmul_params(cfg) == linear_weights


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_param_counts_on_meta(name):
    cfg = GPTConfig.from_preset(name)
    with torch.device("meta"):
        model = GPT(cfg)
    assert num_params(cfg) == count(model)


def test_preset_sizes_match_their_names():
    millions = {n: num_params(GPTConfig.from_preset(n)) / 1e6 for n in PRESETS}
    assert 0.05 < millions["tiny"] < 0.2 and 1 < millions["small"] < 10
    assert 120 < millions["125m"] < 130 and 340 < millions["350m"] < 360  # GPT-2 small / medium
    assert 1000 < millions["1b"] < 1500 and 6600 < millions["7b"] < 6800
    assert GPTConfig.from_preset("tiny", n_layer=3).n_layer == 3


def test_flops_per_token_hand_count():
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
    d, kv, V, L, H, hd, T = 32, 2 * 8, 64, 2, 4, 8, 16
    per_layer = d * d + d * kv + d * kv + d * d + d * 4 * d + 4 * d * d  # wq wk wv wo w1 w2
    n_matmul = L * per_layer + d * V  # + lm_head
    assert num_matmul_params(cfg) == n_matmul == 2 * (2048 + 1024 + 8192) + 2048
    assert flops_per_token(cfg) == 6 * n_matmul + 6 * L * H * (hd + hd) * T
    assert flops_per_token(cfg, seq_len=8) == 6 * n_matmul + 12 * L * H * hd * 8


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"d_model": 30}, "divisible by n_head"),
        ({"n_kv_head": 3}, "divisible by n_kv_head"),
        ({"norm": "batchnorm"}, "norm='batchnorm' must be one of rmsnorm, layernorm"),
    ],
)
def test_config_validation(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**TINY, **bad})
    with pytest.raises(ValueError, match="unknown model preset"):
        GPTConfig.from_preset("13b")


def test_module_names_are_stable():
    cfg = GPTConfig(**TINY)
    names = {n for n, _ in GPT(cfg).named_modules()}
    expected = {
        "tok_emb",
        "pos_emb",
        "norm",
        "lm_head",
        "blocks.1.attn_norm",
        "blocks.1.mlp_norm",
        *GPT.linear_names(cfg),
    }
    assert expected <= names
    assert GPT.linear_names(cfg)[:6] == [
        "blocks.0.attn.wq",
        "blocks.0.attn.wk",
        "blocks.0.attn.wv",
        "blocks.0.attn.wo",
        "blocks.0.mlp.w1",
        "blocks.0.mlp.w2",
    ]


def test_causality():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, 64, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_gqa_equals_mha_with_repeated_kv_weights(n_kv_head):
    torch.manual_seed(0)
    gqa = GPT(GPTConfig(**TINY, n_kv_head=n_kv_head))
    mha = GPT(GPTConfig(**TINY))
    n_rep, hd, d = 4 // n_kv_head, 8, 32
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(
            ("attn.wk.weight", "attn.wv.weight")
        ):  # query head h reads kv head h // n_rep
            state[key] = (
                value.view(n_kv_head, hd, d).repeat_interleave(n_rep, dim=0).reshape(4 * hd, d)
            )
    mha.load_state_dict(state)
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(gqa(idx), mha(idx))


def test_linear_factory_sees_every_linear():
    class TaggedLinear(nn.Linear):
        pass

    calls = []

    def factory(name, in_features, out_features, bias):
        calls.append((name, in_features, out_features, bias))
        return TaggedLinear(in_features, out_features, bias=bias)

    cfg = GPTConfig(**TINY, n_kv_head=2, bias=True)
    model = GPT(cfg, linear_factory=factory)
    assert [c[0] for c in calls] == GPT.linear_names(cfg)
    shapes = {name: (i, o, b) for name, i, o, b in calls}
    assert shapes["blocks.1.attn.wk"] == (32, 16, True)
    assert shapes["blocks.0.mlp.w1"] == (32, 128, True)
    assert shapes["lm_head"] == (32, 64, False)
    assert all(isinstance(model.get_submodule(n), TaggedLinear) for n in GPT.linear_names(cfg))
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == len(calls)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_init_equals_eager_init(tie):
    cfg = GPTConfig(**TINY, tie_embeddings=tie, norm="layernorm", bias=True)
    torch.manual_seed(123)
    eager = GPT(cfg)
    torch.manual_seed(123)
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    assert eager.state_dict().keys() == lazy.state_dict().keys()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(lazy.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert (lazy.lm_head.weight is lazy.tok_emb.weight) == tie
    assert count(lazy) == num_params(cfg)


def test_init_statistics():
    cfg = GPTConfig(
        vocab_size=256, seq_len=64, n_layer=8, n_head=4, d_model=128, bias=True, norm="layernorm"
    )
    model = GPT(cfg)
    assert abs(model.blocks[0].attn.wq.weight.std().item() - 0.02) < 0.001
    assert abs(model.blocks[0].mlp.w2.weight.std().item() - 0.02 / math.sqrt(16)) < 0.0005
    assert torch.all(model.blocks[0].mlp.w1.bias == 0)
    assert torch.all(model.norm.weight == 1) and torch.all(model.norm.bias == 0)


def test_loss_is_cross_entropy_of_logits_and_training_reduces_it():
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("tiny", seq_len=32)
    model = GPT(cfg)
    batcher = TokenBatcher(
        markov_corpus(50_000, vocab_size=256, seed=0), seq_len=32, micro_batch=16
    )
    x, y = batcher.get(0)
    logits = model(x)
    assert logits.shape == (16, 32, 256)
    reference = nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    torch.testing.assert_close(model(x, y), reference)
    assert abs(reference.item() - math.log(256)) < 0.1  # small init: near-uniform predictions

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = model(*batcher.next())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # The chain's unigram entropy is ~ln 256; only learning the transitions gets far below it.
    assert sum(losses[-5:]) / 5 < 2.5 < losses[0]


def test_rejects_too_long_sequence():
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="exceeds the model's seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_the_config_and_its_accounting_need_no_torch():
    """GPTConfig, the presets and the parameter / FLOP counts live apart from the modules
    (dtrain.model.args):
    the cost model, the guide's local check and the config nodes size a model without importing
    torch."""
    import subprocess
    import sys

    import dtrain.model.args as args
    import dtrain.model.gpt as model

    assert (
        model.GPTConfig is args.GPTConfig and model.num_params is args.num_params
    )  # one home, re-exported
    code = (
        "import sys; import dtrain.model.args, dtrain.core.nodes, dtrain.guide.local_check, "
        "dtrain.costmodel.overrides;"
        " from dtrain.core.nodes import model_config; model_config({'preset': '7b'});"
        " print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
