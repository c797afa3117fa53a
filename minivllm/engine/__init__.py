"""The engine layer: LLMEngine (one step at a time), AsyncEngine (background loop), LLM (offline API)."""
