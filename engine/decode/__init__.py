"""Step 5: one decode step. The step plan, append -> select -> resolve -> gather -> attention per
layer, CUDA graphs of the whole step, and sampling."""
