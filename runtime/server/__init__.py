"""kvserve's OpenAI-compatible HTTP server (aiohttp) around one LLMEngine."""
