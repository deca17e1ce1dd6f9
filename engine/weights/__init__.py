"""Step 1 of the data path: model files to weights. GGUF (`gguf`), Hugging Face folders,
synthetic shapes and the embedded SmolLM2; the int4 weight types and ahead-of-time quantising."""
