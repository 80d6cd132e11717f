"""The α–β fit recovers known α, β from synthetic timings."""

import numpy as np
import pytest

from allreduce_bench import busbw
from allreduce_bench.fit import fit_alpha_beta, predict_seconds, r_squared

SIZES = [2**k for k in range(10, 31)]  # 1 KiB .. 1 GiB


def synthetic(alpha_us, beta_GBps, c, noise=0.0, seed=0):
    t = alpha_us * 1e-6 + np.array(SIZES) * c / (beta_GBps * 1e9)
    return t * (1 + noise * np.random.default_rng(seed).standard_normal(len(t)))


@pytest.mark.parametrize("collective, n", [("all_reduce", 8), ("all_gather", 4), ("sendrecv", 2)])
def test_recovers_exact_alpha_beta(collective, n):
    c = busbw.bus_factor(collective, n)
    f = fit_alpha_beta(SIZES, synthetic(25.0, 40.0, c), c)
    assert f.alpha_us == pytest.approx(25.0, rel=1e-6)
    assert f.beta_GBps == pytest.approx(40.0, rel=1e-6)
    assert f.r2 == pytest.approx(1.0) and f.n_points == len(SIZES) and not f.alpha_clamped


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_alpha_beta_within_1pct_under_1pct_noise(seed):
    c = busbw.bus_factor("all_reduce", 8)
    f = fit_alpha_beta(SIZES, synthetic(12.0, 350.0, c, noise=0.01, seed=seed), c)
    assert f.alpha_us == pytest.approx(12.0, rel=0.01)
    assert f.beta_GBps == pytest.approx(350.0, rel=0.01)
    assert f.r2 > 0.999


def test_beta_is_the_large_message_busbw():
    c = busbw.bus_factor("all_reduce", 4)
    f = fit_alpha_beta(SIZES, synthetic(5.0, 100.0, c), c)
    t = predict_seconds(f, 2**40, c)
    assert busbw.busbw_GBps("all_reduce", 2**40, t, 4) == pytest.approx(100.0, rel=1e-4)


def test_negative_alpha_is_clamped_and_flagged():
    c = 1.0
    t = np.array(SIZES[:4]) / 1e9 - 1e-7  # a line that crosses zero slightly below S = 0
    f = fit_alpha_beta(SIZES[:4], t, c)
    assert f.alpha_us == 0.0 and f.alpha_clamped and f.beta_GBps > 0


def test_no_fit_without_a_line():
    assert fit_alpha_beta([1024], [1e-5], 1.0) is None  # one size
    assert fit_alpha_beta([1024, 2048], [1e-5, 2e-5], 0.0) is None  # c = 0 (one rank)
    assert fit_alpha_beta([1024, 2048], [2e-5, 1e-5], 1.0) is None  # time falls with size


def test_r_squared_by_hand():
    y = np.array([1.0, 2.0, 3.0])
    assert r_squared(y, np.array([1.0, 2.0, 4.0])) == pytest.approx(1 - 1 / 2)
    # weights 1, 1, 2: weighted mean 2.25, SS_tot = 1.5625 + 0.0625 + 2 * 0.5625, SS_res = 2 * 1
    assert r_squared(y, np.array([1.0, 2.0, 4.0]), np.array([1.0, 1.0, 2.0])) == pytest.approx(
        1 - 2 / 2.75
    )
