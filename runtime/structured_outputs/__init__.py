"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar."""

from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
