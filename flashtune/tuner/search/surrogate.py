"""The surrogate model of the guided search: a Gaussian process over declared parameters.

Points are rows of parameter-value indices (``ParamSpace`` order). Each parameter is
encoded so that a weighted squared distance between two binary codes is the distance the
kernel sees along that parameter:

- a parameter of three or more values keeps its declared order (a thermometer code: the
  distance of values i and j is |i - j| / (n - 1)), because speed tends to change smoothly
  along an ordered knob;
- a parameter of two values is a switch (distance 1 when they differ).

The kernel is ``exp(-sum_p theta_p * d_p)``: a product over parameters, so it models every
interaction, with one relevance ``theta_p`` per parameter (automatic relevance
determination), fitted with the noise level by maximising the marginal likelihood (L-BFGS,
a weak log-normal prior keeps small samples sane). An optional prior score per point (a
cost model's prediction, another device's measurement) is one more ordered input, so the
model learns from the data how far to trust it.

Everything is plain numpy/scipy and sized for a search, not for a data set: at most
``max_train`` observations (the best half and a random half of the rest) and a few
thousand candidates per decision.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy.linalg as sla
import scipy.optimize as sopt
from scipy.special import ndtr

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Prior centre of log(theta) and log(noise variance) (standardised targets).
_LOG_THETA0 = 0.0
_LOG_NOISE0 = float(np.log(0.05))
#: Prior centre of the logit of the product kernel's share (0: half product, half additive).
_MIX_LOGIT0 = 0.0
#: Variance of the log-normal prior around those centres.
_PRIOR_VAR = 4.0
_JITTER = 1e-6


@dataclass(frozen=True)
class Encoding:
    """Binary codes of points: one block of columns per input, scaled so that the squared
    distance of two codes within a block is the distance along that input."""

    blocks: tuple[FloatArray, ...]  # per input: (n_values x bits) code of each value index

    @staticmethod
    def of(cardinalities: Sequence[int]) -> Encoding:
        blocks = []
        for n in cardinalities:
            idx = np.arange(n)
            if n > 2:  # thermometer: |i - j| / (n - 1)
                code = (idx[:, None] > np.arange(n - 1)[None, :]).astype(np.float64)
                blocks.append(code / np.sqrt(n - 1))
            else:  # a switch (or a constant): distance 1 when different
                blocks.append(np.eye(max(n, 1)) * np.sqrt(0.5))
        return Encoding(tuple(blocks))

    @property
    def inputs(self) -> int:
        return len(self.blocks)

    def codes(self, rows: IntArray) -> list[FloatArray]:
        """Per input, the code of each row's value (rows: points x inputs indices)."""
        return [block[rows[:, j]] for j, block in enumerate(self.blocks)]


def _sqdist(a: FloatArray, b: FloatArray) -> FloatArray:
    d: FloatArray = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    out: FloatArray = np.maximum(d, 0.0)
    return out


def _kernel(dists: FloatArray, theta: FloatArray, mix: float) -> FloatArray:
    """``mix`` times the product kernel ``exp(-sum_p theta_p d_p)`` (every interaction)
    plus ``1 - mix`` times the additive one ``mean_p exp(-theta_p d_p)`` (each parameter on
    its own, which generalises from few points). ``dists``: inputs x a x b."""
    scaled = theta[:, None, None] * dists
    k: FloatArray = mix * np.exp(-scaled.sum(0))
    if mix < 1.0:
        k = k + (1.0 - mix) * np.exp(-scaled).mean(0)
    return k


class GaussianProcess:
    """A GP on encoded points (see the module docstring); targets are standardised here.
    ``additive``: the kernel mixes in an additive part, its weight fitted with the rest."""

    def __init__(self, encoding: Encoding, extra: int = 0, *, additive: bool = True) -> None:
        self.encoding = encoding
        self.extra = extra  # continuous inputs in [0, 1] appended to each point (a prior)
        self.additive = additive
        self.log_theta = np.full(encoding.inputs + extra, _LOG_THETA0)
        self.mix_logit = _MIX_LOGIT0 if additive else np.inf
        self.log_noise = _LOG_NOISE0
        self._train: list[FloatArray] = []
        self._z: FloatArray = np.zeros(0)
        self._dists: FloatArray = np.zeros((0, 0, 0))
        self._chol: FloatArray | None = None
        self._alpha: FloatArray | None = None
        self._scale2 = 1.0
        self.y_mean = 0.0
        self.y_std = 1.0
        self.y_best = 0.0

    @property
    def mix(self) -> float:
        return float(1.0 / (1.0 + np.exp(-self.mix_logit)))

    # ------------------------------------------------------------------ inputs

    def _codes(self, rows: IntArray, extra: FloatArray | None) -> list[FloatArray]:
        codes = self.encoding.codes(rows)
        if self.extra:
            assert extra is not None and extra.shape == (len(rows), self.extra)
            codes += [extra[:, [k]] for k in range(self.extra)]
        return codes

    # ------------------------------------------------------------------ fitting

    def fit(self, rows: IntArray, extra: FloatArray | None, y: FloatArray, *,
            optimise: bool, max_iter: int = 25) -> None:
        """Condition on (rows, y) (lower y is better); re-fit the hyperparameters when
        ``optimise``."""
        self.y_mean = float(y.mean())
        self.y_std = float(y.std()) or 1.0
        self._z = (y - self.y_mean) / self.y_std
        self._train = self._codes(rows, extra)
        self._dists = np.stack([_sqdist(c, c) for c in self._train])  # inputs x n x n
        if optimise and len(self._z) >= 3:
            self._optimise(self._z, self._dists, max_iter)
        self._condition()

    def _condition(self) -> None:
        """Factor the kernel matrix of the training points at the current hyperparameters."""
        z = self._z
        k = _kernel(self._dists, np.exp(self.log_theta), self.mix)
        k[np.diag_indices_from(k)] += np.exp(self.log_noise) + _JITTER
        chol = sla.cholesky(k, lower=True, check_finite=False)
        alpha = sla.cho_solve((chol, True), z, check_finite=False)
        self._chol, self._alpha = chol, alpha
        self._scale2 = max(float(z @ alpha) / len(z), 1e-6)  # profiled signal variance
        self.y_best = float(z.min())

    def at_prior_relevances(self) -> GaussianProcess:
        """This model on the same data with every relevance at the prior's centre (the
        noise and the product's share stay as fitted): what the data say without the
        relevances fitted from them, which a handful of points can make extreme."""
        other = copy.copy(self)
        other.log_theta = np.full_like(self.log_theta, _LOG_THETA0)
        other._condition()
        return other

    def _optimise(self, z: FloatArray, dists: FloatArray, max_iter: int) -> None:
        inputs = len(self.log_theta)
        mixed = self.additive
        h0 = np.r_[self.log_theta, self.mix_logit if mixed else 0.0, self.log_noise]
        centre = np.r_[np.full(inputs, _LOG_THETA0), _MIX_LOGIT0, _LOG_NOISE0]
        n = len(z)
        eye = np.eye(n)

        def objective(h: FloatArray) -> tuple[float, FloatArray]:
            theta, noise = np.exp(h[:inputs]), float(np.exp(h[-1]))
            mix = float(1.0 / (1.0 + np.exp(-h[inputs]))) if mixed else 1.0
            parts = np.exp(-theta[:, None, None] * dists)  # per input
            prod = np.exp(-(theta[:, None, None] * dists).sum(0))
            k = mix * prod + (1.0 - mix) * parts.mean(0) + (noise + _JITTER) * eye
            try:
                chol = sla.cholesky(k, lower=True, check_finite=False)
            except np.linalg.LinAlgError:
                return 1e10, np.zeros_like(h)
            alpha = sla.cho_solve((chol, True), z, check_finite=False)
            quad = max(float(z @ alpha), 1e-12)
            # signal variance profiled out: -log L = n/2 log(z'K^-1 z) + log|L| + const
            value = 0.5 * n * np.log(quad) + float(np.log(np.diag(chol)).sum())
            k_inv = sla.cho_solve((chol, True), eye, check_finite=False)
            w = np.outer(alpha, alpha) * (n / quad) - k_inv
            # d(-log L)/dh = -1/2 tr(W dK/dh)
            d_theta = -(mix * prod[None] + (1.0 - mix) / inputs * parts) * dists * \
                theta[:, None, None]
            grad = np.empty_like(h)
            grad[:inputs] = -0.5 * np.einsum("ij,kij->k", w, d_theta)
            grad[inputs] = (-0.5 * mix * (1.0 - mix) * float((w * (prod - parts.mean(0))).sum())
                            if mixed else 0.0)
            grad[-1] = -0.5 * noise * float(np.trace(w))
            diff = h - centre
            if not mixed:
                diff[inputs] = 0.0
            return value + 0.5 * float(diff @ diff) / _PRIOR_VAR, grad + diff / _PRIOR_VAR

        bounds = [(-5.0, 4.0)] * inputs + [(-6.0, 6.0), (-9.0, 0.0)]
        res = sopt.minimize(objective, h0, jac=True, method="L-BFGS-B", bounds=bounds,
                            options={"maxiter": max_iter})
        if np.all(np.isfinite(res.x)):
            self.log_theta, self.log_noise = res.x[:inputs].copy(), float(res.x[-1])
            if mixed:
                self.mix_logit = float(res.x[inputs])

    # ------------------------------------------------------------------ prediction

    def predict(self, rows: IntArray, extra: FloatArray | None
                ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Standardised posterior mean and standard deviation of ``rows``, and their
        weighted codes (for ``correlation``)."""
        assert self._chol is not None and self._alpha is not None
        theta = np.exp(self.log_theta)
        codes = self._codes(rows, extra)
        dists = np.stack([_sqdist(c, t) for c, t in zip(codes, self._train, strict=True)])
        ks = _kernel(dists, theta, self.mix)
        mean = ks @ self._alpha
        v = sla.solve_triangular(self._chol, ks.T, lower=True, check_finite=False)
        var = self._scale2 * np.maximum(1.0 - (v * v).sum(0), 1e-12)
        wc = np.hstack([c * np.sqrt(t) for c, t in zip(codes, theta, strict=True)])
        return mean, np.sqrt(var), wc


def expected_improvement(mean: FloatArray, sd: FloatArray, best: float) -> FloatArray:
    """Expected amount by which each point undercuts ``best`` (lower is better)."""
    gap = best - mean
    u = gap / sd
    out: FloatArray = gap * ndtr(u) + sd * np.exp(-0.5 * u * u) / np.sqrt(2.0 * np.pi)
    return out


def correlation(codes: FloatArray, row: int) -> FloatArray:
    """Kernel correlation of every candidate with candidate ``row`` (weighted codes)."""
    d = ((codes - codes[row]) ** 2).sum(1)
    out: FloatArray = np.exp(-d)
    return out
