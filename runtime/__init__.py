"""kvserve's LLM inference runtime: paged KV cache, continuous batching, HF Llama-family models."""
