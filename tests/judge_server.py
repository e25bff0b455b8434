"""A small OpenAI-compatible chat completions server for the judge's tests, on 127.0.0.1 in a thread.

It speaks POST /v1/chat/completions as vLLM's and SGLang's servers do (JSON in, `choices[0].message.content`
out). How it answers depends on the requested model name:

- "grader": reads "Reference answer: R" and "Answer to grade: A" from the default judge prompt and replies
  "10" when A equals R, else the number len(A) % 10 (so scores vary and a test can compute them itself);
- "chatty": replies in words ("I would give it 7 out of 10."), which does not parse;
- "slow": waits 5 s before answering;
- "busy": answers 503 to the first request of each conversation, then as "grader".

Every request's headers and body are kept in `requests` for the tests to inspect.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROMPT = re.compile(r"Reference answer: (?P<reference>.*)\nAnswer to grade: (?P<answer>.*)\nHow well",
                    re.DOTALL)


def grade(text: str) -> str:
    found = PROMPT.search(text)
    if found is None:
        return "no reference in the prompt"
    answer, reference = found["answer"].strip(), found["reference"].strip()
    return "10" if answer == reference else str(len(answer) % 10)


def user_text(messages: list[dict]) -> str:
    content = messages[-1]["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content
                                                            if p["type"] == "text")


class JudgeServer:
    def __init__(self):
        self.requests: list[dict] = []
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if self.path != "/v1/chat/completions":
                    return self.reply(404, {"error": f"no route {self.path}"})
                text, model = user_text(body["messages"]), body["model"]
                if model == "busy":
                    with server.lock:
                        first = text not in server.seen
                        server.seen.add(text)
                    if first:
                        return self.reply(503, {"error": "busy, try again"})
                if model == "slow":
                    time.sleep(5)
                said = "I would give it 7 out of 10." if model == "chatty" else grade(text)
                self.reply(200, {"id": "x", "object": "chat.completion", "model": model,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": said}}]})

            def reply(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> JudgeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
