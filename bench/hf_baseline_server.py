"""Baseline for bench/serve.py: a minimal OpenAI /v1/completions server that answers each
request with transformers `generate`, one request at a time (no batching, no paged KV cache).

    python bench/hf_baseline_server.py MODEL_DIR --port 8001

Accepts what bench/serve.py sends: token-id or string prompts, max_tokens, temperature,
ignore_eos, stream (+ stream_options.include_usage). Tokens stream as they are generated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
import uuid

import torch  # noqa: E402
from aiohttp import web  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

log = logging.getLogger("hf-baseline")


class QueueStreamer(BaseStreamer):
    """Hands each new token id to the event loop; the first put() is the prompt and is skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for t in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, t)

    def end(self):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def build_app(model_dir: str, name: str) -> web.Application:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lock = asyncio.Lock()  # one generate at a time: this is the baseline's whole scheduling policy

    def generate(ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool, streamer):
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else 0,
                           do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                           top_p=None, top_k=None, streamer=streamer, pad_token_id=tok.pad_token_id or 0)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0) or 0.0)
        stream = bool(body.get("stream"))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        rid = f"cmpl-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        resp = None
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
        out_ids: list[int] = []
        async with lock:
            worker = threading.Thread(target=generate, daemon=True, args=(
                ids, max_tokens, temperature, bool(body.get("ignore_eos")), QueueStreamer(loop, queue)))
            worker.start()
            while (t := await queue.get()) is not None:
                out_ids.append(t)
                if stream:
                    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
                             "choices": [{"index": 0, "text": tok.decode([t]), "finish_reason": None}]}
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.to_thread(worker.join)
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out_ids), "total_tokens": len(ids) + len(out_ids)}
        finish = "length" if len(out_ids) >= max_tokens else "stop"
        if not stream:
            return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                      "model": name, "usage": usage,
                                      "choices": [{"index": 0, "text": tok.decode(out_ids), "finish_reason": finish}]})
        final = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
                 "choices": [{"index": 0, "text": "", "finish_reason": finish}]}
        await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        if usage_wanted:
            await resp.write(f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def ready(request):
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", ready)
    return app


async def serve(args) -> None:
    app = build_app(args.model, args.served_model_name or args.model)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    log.info("listening on http://%s:%d", args.host, port)
    stop = asyncio.Event()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
