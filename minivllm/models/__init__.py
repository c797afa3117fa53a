"""Model definitions (Llama family), the architecture registry, and weight loading (HF folders, GGUF,
dummy). Models see only (input_ids, positions) and the forward context; they never touch scheduling."""
