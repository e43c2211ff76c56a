"""The guided search's Gaussian process against a posterior written out from its definition."""

from __future__ import annotations

import os

import numpy as np

from flashtune.tuner.search.surrogate import Encoding, GaussianProcess


def _reference_posterior(train: np.ndarray, z: np.ndarray, test: np.ndarray,
                         theta: np.ndarray, mix: float, noise: float
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation of a GP on two inputs, an ordered one of 5 values
    (distance |i - j| / 4) and a switch (distance 1 when different), its signal variance
    the maximum-likelihood one (z' K^-1 z / n)."""
    def kernel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d = np.stack([np.abs(a[:, None, 0] - b[None, :, 0]) / 4.0,
                      (a[:, None, 1] != b[None, :, 1]).astype(float)])
        scaled = theta[:, None, None] * d
        out: np.ndarray = mix * np.exp(-scaled.sum(0)) + (1 - mix) * np.exp(-scaled).mean(0)
        return out

    k = kernel(train, train) + (noise + 1e-6) * np.eye(len(train))
    ks = kernel(test, train)
    mean = ks @ np.linalg.solve(k, z)
    scale2 = float(z @ np.linalg.solve(k, z)) / len(z)
    var = scale2 * (1.0 - np.einsum("ij,ji->i", ks, np.linalg.solve(k, ks.T)))
    return mean, np.sqrt(np.maximum(var, 1e-12 * scale2))


def test_the_model_at_prior_relevances_keeps_the_data_and_drops_the_fitted_relevances() -> None:
    rng = np.random.default_rng(int(os.environ["FLASHTUNE_TEST_SEED"]))
    grid = np.array([(i, j) for i in range(5) for j in range(2)], dtype=np.int64)
    train = grid[rng.choice(len(grid), 6, replace=False)]
    y = rng.normal(size=len(train)) + 3.0 * (train[:, 0] == 2)  # one value far off
    gp = GaussianProcess(Encoding.of([5, 2]))
    gp.fit(train, None, y, optimise=True)
    fitted_theta = gp.log_theta.copy()
    before = gp.predict(grid, None)

    hedge = gp.at_prior_relevances()

    # the fitted model is untouched
    assert np.array_equal(gp.log_theta, fitted_theta)
    for a, b in zip(before, gp.predict(grid, None), strict=True):
        assert np.array_equal(a, b)
    # the hedge: relevances 1, the same data, noise and product share
    assert np.array_equal(hedge.log_theta, np.zeros(2))
    assert (hedge.mix, hedge.log_noise, hedge.y_best) == (gp.mix, gp.log_noise, gp.y_best)
    z = (y - y.mean()) / y.std()
    for model, theta in ((gp, np.exp(fitted_theta)), (hedge, np.ones(2))):
        mean, sd, _ = model.predict(grid, None)
        ref_mean, ref_sd = _reference_posterior(train.astype(float), z, grid.astype(float),
                                                theta, model.mix, float(np.exp(model.log_noise)))
        np.testing.assert_allclose(mean, ref_mean, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(sd, ref_sd, rtol=1e-5, atol=1e-9)
    # the two models differ where the fitted relevances matter
    assert not np.allclose(hedge.predict(grid, None)[1], before[1])
