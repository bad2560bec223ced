"""The sidecar agent: fetches the model into the pod and standardizes the engine's metrics."""
