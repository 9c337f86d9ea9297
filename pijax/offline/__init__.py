"""The offline compiler's library: activation predictors and hot/cold neuron placement.

Its CLIs (`pijax.profile`, `pijax.train_predictors`, `pijax.place`, `pijax.convert`) stay at the
package top level with the other commands.
"""
