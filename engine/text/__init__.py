"""Step 2: text to token ids. Tokenizers (GGUF and HF), chat templates and prompt building."""
