"""The MoE feed-forward (dtrain.model.moe): the three expert GEMM paths agree (loop = the
reference; the padded batched emulation; torch._grouped_mm where this torch runs it), the layer
equals a per-token reference, capacity drops what is over it, Switch's loss and DeepSeek-V3's bias
update by hand, parameter and FLOP counts, the per-step metrics, and `model.moe.*` config errors."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dtrain.model.args import GPTConfig, model_dict, num_matmul_params, num_params
from dtrain.model.flops import flops_per_token
from dtrain.model.gpt import GPT, moe_layers
from dtrain.model.moe import experts_grouped, experts_loop, experts_padded
from dtrain.model.moe_args import MoEArgs
from dtrain.train.moe_metrics import MoEMetrics

SEED = 1234


def moe_model(**moe) -> GPTConfig:
    return GPTConfig.from_preset("tiny", moe=MoEArgs(**{"experts": 4, "top_k": 2, **moe}))


def _rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    counts = [5, 0, 11, 3]  # an expert without rows included
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    w1 = torch.randn(4, 16, 24, generator=g, requires_grad=True)
    w2 = torch.randn(4, 24, 16, generator=g, requires_grad=True)
    return counts, x, w1, w2


@pytest.mark.parametrize("impl", [experts_padded, experts_grouped])
def test_grouped_paths_equal_the_per_expert_loop(impl):
    print(f"seed {SEED}")
    counts, x, w1, w2 = _rows(SEED)
    ref = experts_loop(x, counts, w1, w2)
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, w1, w2))
    if impl is experts_grouped:
        try:
            got = impl(x, counts, w1, w2)
        except (RuntimeError, NotImplementedError) as e:  # CUDA sm90+ only in older torch
            pytest.skip(f"torch._grouped_mm does not run here: {e}")
    else:
        got = impl(x, counts, w1, w2)
    grads = torch.autograd.grad(got.square().sum(), (x, w1, w2))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gemm", ["loop", "padded"])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_layer_equals_a_per_token_reference(router, gemm):
    torch.manual_seed(SEED)
    model = GPT(moe_model(router=router, gemm=gemm, shared_experts=1))
    moe = moe_layers(model)[0]
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(2, 8, 64)
    got = moe(x)
    flat = x.reshape(-1, 64)
    idx, weights, _ = moe.router(flat)
    want = moe.shared(flat).clone()
    for t in range(flat.shape[0]):
        for j in range(2):
            e = int(idx[t, j])
            h = torch.nn.functional.gelu(flat[t] @ moe.experts.w1[e], approximate="tanh")
            want[t] += weights[t, j] * (h @ moe.experts.w2[e])
    torch.testing.assert_close(got.reshape(-1, 64), want, rtol=1e-5, atol=1e-6)
    if router == "softmax":  # Mixtral / Qwen3: the top-k weights renormalised
        torch.testing.assert_close(weights.sum(-1), torch.ones(16))


def _all_to_experts_0_and_1(**moe):
    """A sigmoid router whose gate is zero: every score 0.5, the bias picks experts 0 and 1."""
    torch.manual_seed(SEED)
    model = GPT(moe_model(router="sigmoid", gemm="loop", **moe))
    layer = moe_layers(model)[0]
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.expert_bias.copy_(torch.tensor([1.0, 0.5, 0.0, 0.0]))
    return layer


def test_capacity_factor_drops_what_is_over_capacity_in_token_order():
    layer = _all_to_experts_0_and_1(capacity_factor=1.0)
    x = torch.randn(1, 16, 64)
    out = layer(x)[0]
    # capacity ceil(1.0 * 16 * 2 / 4) = 8 per expert: tokens 8..15 lose both assignments
    assert layer.stats["dropped"] == 16
    assert layer.stats["tokens_per_expert"].tolist() == [16, 16, 0, 0]  # routed, before drops
    assert torch.all(out[8:] == 0) and torch.all(out[:8].abs().sum(-1) > 0)
    dropless = _all_to_experts_0_and_1()
    assert dropless(x).abs().sum(-1).min() > 0 and dropless.stats["dropped"] == 0


def test_switch_aux_loss_is_the_coefficient_under_uniform_routing():
    """Uniform router probabilities: P_i = 1/E, sum_i f_i = 1, so coef * E * sum f_i P_i = coef."""
    torch.manual_seed(SEED)
    model = GPT(moe_model(aux_loss_coef=0.01, gemm="loop"))
    for layer in moe_layers(model):
        with torch.no_grad():
            layer.router.gate.weight.zero_()
    idx = torch.randint(0, 256, (2, 16))
    loss = model(idx, idx)
    ce = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    aux = [layer.aux_loss for layer in moe_layers(model)]
    assert all(abs(a.item() - 0.01) < 1e-7 for a in aux)
    assert abs(loss.item() - ce.item() - 0.02) < 1e-6  # two MoE layers


def test_bias_update_moves_towards_the_mean_load():
    layer = _all_to_experts_0_and_1(bias_update_rate=0.001)
    metrics = MoEMetrics([torch.nn.ModuleList([layer])], ep=1)
    before = layer.router.expert_bias.clone()
    metrics._update_bias(torch.tensor([[10.0, 0.0, 5.0, 5.0]], dtype=torch.float64))
    delta = (layer.router.expert_bias - before).tolist()
    assert delta == pytest.approx([-0.001, 0.001, 0.0, 0.0], abs=1e-7)  # fp32 bias of ~1


def test_step_metrics_count_tokens_and_the_overload_factor():
    torch.manual_seed(SEED)
    model = GPT(moe_model(gemm="loop"))
    idx = torch.randint(0, 256, (2, 64))
    model(idx, idx)
    layers = moe_layers(model)
    counts = [layer.stats["tokens_per_expert"].clone() for layer in layers]
    metrics = MoEMetrics([model], ep=1)
    trainer = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    m = {"warmup_step": False}
    metrics.on_step_end(trainer, 1, m)
    assert sum(m["moe_tokens_per_expert"]) == 2 * 64 * 2 * len(layers)  # tokens x k x layers
    want = max(float(c.max()) / (float(c.sum()) / 4) for c in counts)
    assert m["moe_overload"] == pytest.approx(want) == m["moe_expert_overload"]
    assert m["moe_dropped"] == 0 and layers[0].stats["tokens_per_expert"] is None  # reset
    assert metrics.summary()["moe_overload_mean"] == pytest.approx(want)


@pytest.mark.parametrize(
    "moe",
    [
        {},
        {"shared_experts": 2, "dense_layers": 1, "expert_ffn": 96},
        {"router": "sigmoid", "experts": 8, "top_k": 3},
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_parameter_count_is_the_module_count(moe, bias):
    cfg = moe_model(**moe)
    cfg.bias = bias
    model = GPT(cfg)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    linears = sum(model.get_submodule(n).weight.numel() for n in GPT.linear_names(cfg))
    experts = sum(m.experts.w1.numel() + m.experts.w2.numel() for m in moe_layers(model))
    assert num_matmul_params(cfg) == linears + experts


def test_flops_count_the_active_experts_by_hand():
    """tiny: d 64, dense hidden 256, 2 layers; 4 experts of 256, top-2, no shared: each MoE layer
    multiplies 2 experts' 2·64·256 weights instead of the dense 2·64·256 (router not counted)."""
    dense = GPTConfig.from_preset("tiny")
    assert flops_per_token(moe_model()) - flops_per_token(dense) == 6 * 2 * (2 - 1) * 2 * 64 * 256
    one_shared = moe_model(top_k=1, shared_experts=1, expert_ffn=128, dense_layers=1)
    assert flops_per_token(one_shared) - flops_per_token(dense) == 6 * 1 * (
        2 * 2 * 64 * 128 - 2 * 64 * 256
    )


def test_a_record_dict_round_trips_and_a_dense_model_has_no_moe_key():
    cfg = moe_model(shared_experts=1)
    assert GPTConfig(**model_dict(cfg)) == cfg
    assert "moe" not in model_dict(GPTConfig.from_preset("tiny"))
    assert GPTConfig.from_preset("tiny", moe=MoEArgs(experts=0)).moe is None


E4 = "model.moe.experts=4"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([E4, "model.moe.top_k=5"], "model: moe.top_k=5 must be an integer >= 1 and <= 4"),
        ([E4, "model.moe.router=relu"], "model: moe.router='relu' must be one of softmax, sigmoid"),
        (
            [E4, "model.moe.capacity_factor=0"],
            "model: moe.capacity_factor=0.0 must be a finite number > 0 or null",
        ),
        (
            [E4, "model.moe.dense_layers=2"],
            "model: moe.dense_layers=2 must be an integer >= 0 and <= 1",
        ),
        (["model.moe.expert=4"], "unknown key model.moe.expert: did you mean model.moe.experts"),
        (
            ["train.ep=2", "model.moe.experts=3", "model.moe.top_k=1"],
            "model.moe.experts=3 is not divisible by train.ep=2",
        ),
    ],
)
def test_bad_moe_values_are_one_line_errors(overrides, message, tmp_path):
    cmd = [sys.executable, "-m", "fsdp_scaling", f"results_dir={tmp_path}", "model.preset=tiny"]
    proc = subprocess.run(cmd + overrides, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert not any(tmp_path.iterdir())  # nothing half-written
