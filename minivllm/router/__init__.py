"""A cache-aware router in front of several minivllm (or any OpenAI-compatible) servers."""
