"""The model as Flax modules: the transformer (dense FFN), the hybrid sparse FFN, what "active" means."""
