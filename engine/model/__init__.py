"""Step 3: the model forward. Llama-family layers, 4-bit linears and RoPE."""
