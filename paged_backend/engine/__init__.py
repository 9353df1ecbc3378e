"""The engine: requests in, outputs out (LLMEngine, AsyncEngine, LLM)."""
