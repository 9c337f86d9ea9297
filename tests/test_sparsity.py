"""The activation definition per FFN family and threshold calibration."""

import jax.numpy as jnp
import numpy as np
import pytest

from pijax import config as config_lib
from pijax.nn import sparsity

GATE = jnp.asarray([[-2.0, -0.1, 0.0, 0.3, 1.5, 4.0]])
UP = jnp.asarray([[1.0, -3.0, 2.0, -0.5, 0.0, 0.2]])


def test_reglu_active_iff_relu_gate_positive():
  got = np.asarray(sparsity.active_mask(GATE, UP, config_lib.FFN_REGLU))
  np.testing.assert_array_equal(got, [[False, False, False, True, True, True]])


def test_drelu_needs_gate_and_up_positive():
  got = np.asarray(sparsity.active_mask(GATE, UP, config_lib.FFN_DRELU))
  np.testing.assert_array_equal(got, [[False, False, False, False, False, True]])


def test_relu_mlp_uses_up_plus_bias():
  got = np.asarray(sparsity.active_mask(GATE, UP, config_lib.FFN_RELU_MLP))
  np.testing.assert_array_equal(got, [[True, False, True, False, False, True]])


def test_swiglu_contribution_threshold():
  silu = np.asarray(GATE) / (1 + np.exp(-np.asarray(GATE)))
  contrib = np.abs(silu * np.asarray(UP))
  np.testing.assert_allclose(
      np.asarray(sparsity.neuron_contribution(GATE, UP, config_lib.FFN_SWIGLU)), contrib,
      rtol=1e-6)
  for t in (0.0, 0.05, 0.2, 1.0):
    got = np.asarray(sparsity.active_mask(GATE, UP, config_lib.FFN_SWIGLU, t))
    np.testing.assert_array_equal(got, contrib >= t)
  # Threshold 0: every neuron active (also the ones with exactly zero output).
  assert np.asarray(sparsity.active_mask(GATE, UP, config_lib.FFN_SWIGLU, 0.0)).all()


@pytest.mark.parametrize("target", [0.0, 0.3, 0.5, 0.9])
def test_calibrate_threshold_hits_target(target):
  values = np.abs(np.random.default_rng(1).standard_cauchy((400, 256))).astype(np.float32)
  t = sparsity.calibrate_threshold(values, target)
  assert abs((values < t).mean() - target) <= 1e-3


def test_calibrate_threshold_rejects_bad_target():
  with pytest.raises(ValueError):
    sparsity.calibrate_threshold(np.ones(4), 1.0)
