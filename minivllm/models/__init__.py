"""Model definitions (the Llama family and the MoE models built on its decoder, GPT-2, Phi-3, Gemma), the
architecture registry, and weight loading (HF folders, GGUF, dummy). Models see only (input_ids,
positions) and the forward context; they never touch scheduling."""
