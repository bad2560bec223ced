"""The speculative-decoding server tests' shared setup: the offline engine's greedy text without
speculation (the oracle), and `kvserve serve --speculative-config ...` with an openai client."""

from __future__ import annotations

import json
from contextlib import contextmanager

from server_helpers import http, wait_until

# The same small pool for the oracle and the server, so both schedule alike.
POOL = dict(block_size=16, num_kv_blocks=64, max_model_len=256)


def plain_greedy_texts(model, prompts: list[list[int]], max_tokens: int = 16) -> list[str]:
    from kvserve.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model), **POOL) as llm:
        return [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@contextmanager
def spec_server(model, spec: dict):
    """Yields (server url, openai client) for `model` served as "tiny" with `spec`."""
    import openai

    from kvserve.runtime.server.main import ServerThread

    srv = ServerThread([str(model), "--served-model-name", "tiny", "--port", "0",
                        "--block-size", str(POOL["block_size"]), "--num-kv-blocks", str(POOL["num_kv_blocks"]),
                        "--max-model-len", str(POOL["max_model_len"]), "--speculative-config", json.dumps(spec)])
    srv.start()
    try:
        wait_until(lambda: http(srv.url, "GET", "/ready")[0] == 200, timeout=120)
        yield srv.url, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    finally:
        assert srv.stop() == 0
