"""OpenAI-compatible HTTP server over the AsyncEngine (FastAPI + uvicorn); nothing here touches tensors."""
