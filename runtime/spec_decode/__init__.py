"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection sampler,
and the step that verifies k drafted tokens with one target forward pass over k + 1 positions."""

from kvserve.runtime.spec_decode.config import SpeculativeConfig
from kvserve.runtime.spec_decode.ngram import ngram_propose
from kvserve.runtime.spec_decode.rejection import greedy_verify, rejection_sample

__all__ = ["SpeculativeConfig", "greedy_verify", "ngram_propose", "rejection_sample"]
