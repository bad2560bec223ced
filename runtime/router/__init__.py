"""`kvserve router`: cache-aware routing in front of an InferenceService's pods, and the request
hold that makes scale to zero lose nothing (docs/router.md)."""
