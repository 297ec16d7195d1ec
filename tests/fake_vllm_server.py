"""A small real HTTP server speaking the subset of vLLM's OpenAI API the vllm_server engine
uses (/health, /v1/models, /v1/completions with token-id prompts, LoRA load/unload), for the
main env's tests, where vllm is not installed. The real server is tested in tests/engines.

The "model" is a script: ``next_tokens(prompt_ids, request) -> list[int]`` gives the reply
before the server applies ``max_tokens``, stop ids and stop strings the way vLLM does (stop on
the token that completes a stop string, kept in the output with ``include_stop_str_in_output``).
The log-prob of the k-th token is ``-(k + 1) / 10``, so a test can tell them apart.

``chat`` (optional) scripts ``POST /v1/chat/completions`` (an LLM judge's route):
``chat(request) -> str`` is the assistant message's content, or ``(status, body)`` to answer
with that HTTP status and JSON body; without it the route answers 404 as before. Its requests
go to ``chat_requests``; ``chat_fail_status`` / ``chat_fail_times`` inject failures as
``fail_status`` / ``fail_times`` do for completions.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeVLLM:
    def __init__(self, tokenizer, next_tokens: Callable[[list[int], dict], list[int]],
                 model: str = "base-model", delay_s: float = 0.0,
                 chat: Callable[[dict], str | tuple[int, Any]] | None = None):
        self.tokenizer = tokenizer
        self.next_tokens = next_tokens
        self.model = model
        self.delay_s = delay_s
        self.fail_status: int | None = None  # answer completions with this HTTP status
        self.fail_times = 0  # ... this many times (then answer normally)
        self.requests: list[dict[str, Any]] = []
        self.chat = chat
        self.chat_requests: list[dict[str, Any]] = []
        self.chat_fail_status: int | None = None
        self.chat_fail_times = 0
        self.adapters: dict[str, str] = {}  # name -> path
        self.adapter_calls: list[tuple[str, dict]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, obj: Any = None) -> None:
                data = b"" if obj is None else json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200)
                if self.path == "/v1/models":
                    data = [{"id": fake.model, "root": fake.model, "parent": None}]
                    data += [{"id": n, "root": p, "parent": fake.model} for n, p in fake.adapters.items()]
                    return self._send(200, {"object": "list", "data": data})
                return self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/v1/completions":
                    return fake._complete(self, body)
                if self.path == "/v1/chat/completions" and fake.chat is not None:
                    return fake._chat(self, body)
                if self.path == "/v1/load_lora_adapter":
                    fake.adapter_calls.append(("load", body))
                    fake.adapters[body["lora_name"]] = body["lora_path"]
                    return self._send(200)
                if self.path == "/v1/unload_lora_adapter":
                    fake.adapter_calls.append(("unload", body))
                    fake.adapters.pop(body["lora_name"], None)
                    return self._send(200)
                return self._send(404, {"error": "not found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def _complete(self, handler, body: dict) -> None:
        with self._lock:
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            fail = self.fail_status if self.fail_times > 0 else None
            if fail:
                self.fail_times -= 1
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if fail:
                return handler._send(fail, {"error": {"message": "injected failure", "code": fail}})
            if body.get("model") not in (self.model, *self.adapters):
                return handler._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                     "code": 404}})
            handler._send(200, self._reply(body))
        finally:
            with self._lock:
                self.in_flight -= 1

    def _chat(self, handler, body: dict) -> None:
        assert self.chat is not None
        with self._lock:
            self.chat_requests.append(body)
            fail = self.chat_fail_status if self.chat_fail_times > 0 else None
            if fail:
                self.chat_fail_times -= 1
        if fail:
            return handler._send(fail, {"error": {"message": "injected failure", "code": fail}})
        if body.get("model") not in (self.model, *self.adapters):
            return handler._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                 "code": 404}})
        out = self.chat(body)
        if isinstance(out, tuple):
            return handler._send(*out)
        handler._send(200, {"object": "chat.completion", "model": body["model"], "choices": [{
            "index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": "stop"}]})

    def _reply(self, body: dict) -> dict:
        planned = self.next_tokens(list(body["prompt"]), body)
        out: list[int] = []
        finish, stop_reason = "length", None
        for t in planned[: body.get("max_tokens", 16)]:
            out.append(t)
            if t in (body.get("stop_token_ids") or []):
                finish, stop_reason = "stop", t
                break
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            hit = next((s for s in body.get("stop") or [] if s in text), None)
            if hit is not None:
                finish, stop_reason = "stop", hit
                break
        lps = [-(k + 1) / 10 for k in range(len(out))]
        return {"object": "text_completion", "model": body["model"], "choices": [{
            "index": 0, "text": self.tokenizer.decode(out), "finish_reason": finish, "stop_reason": stop_reason,
            "logprobs": {"tokens": [f"token_id:{t}" for t in out], "token_logprobs": lps,
                         "top_logprobs": [{f"token_id:{t}": v} for t, v in zip(out, lps)],
                         "text_offset": list(range(len(out)))}}]}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
