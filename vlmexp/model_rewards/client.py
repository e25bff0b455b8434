"""An OpenAI-compatible chat client for the judge: POST <endpoint>/chat/completions (vLLM's and SGLang's
servers, `transformers serve`, hosted APIs), with httpx.

Each conversation is one request; a batch goes out with at most `concurrency` requests in flight. A request
that times out, cannot connect, or gets 429 or a 5xx answer is tried again after `backoff * 2**k` seconds, up
to `retries` more times; any other error answer, or the last failure, raises `ModelRewardError` naming the
endpoint and the fix. Nothing waits without a limit: every request has the `timeout`. The API key is read from
the environment variable the config names, sent as a bearer token, and never put in a message or a log.
"""

from __future__ import annotations

import base64
import mimetypes
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vlmexp.model_rewards.base import ModelRewardError

RETRIED_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)


def chat_url(endpoint: str) -> str:
    """The chat completions URL of an endpoint given as its base (`http://host:port/v1`) or as that URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/chat/completions") else f"{endpoint}/chat/completions"


def image_part(path: str) -> dict[str, Any]:
    """An image file as an OpenAI `image_url` part holding a data URL."""
    kind = mimetypes.guess_type(path)[0] or "image/png"
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{data}"}}


@dataclass(frozen=True)
class ChatClient:
    endpoint: str
    model: str
    timeout: float
    retries: int
    backoff: float
    concurrency: int
    max_tokens: int
    api_key_env: str | None = None

    def headers(self) -> dict[str, str]:
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ModelRewardError(f"judge: the environment variable {self.api_key_env} (kwargs.api_key_env) "
                                   "that holds the endpoint's API key is not set; export it in the training "
                                   "process's environment")
        return {"Authorization": f"Bearer {key}"}

    def complete(self, conversations: list[list[dict[str, Any]]]) -> tuple[list[str], int]:
        """(the reply text of each conversation, the requests made), in order."""
        import httpx

        headers = self.headers()
        workers = min(self.concurrency, max(1, len(conversations)))
        with httpx.Client(timeout=httpx.Timeout(self.timeout), headers=headers) as http, \
                ThreadPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(lambda messages: self._one(http, messages), conversations))
        return [text for text, _ in done], sum(tries for _, tries in done)

    def _one(self, http, messages: list[dict[str, Any]]) -> tuple[str, int]:
        import httpx

        url = chat_url(self.endpoint)
        body = {"model": self.model, "messages": messages, "temperature": 0.0, "max_tokens": self.max_tokens}
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = http.post(url, json=body)
            except httpx.TimeoutException:
                problem = f"did not answer within {self.timeout:g} s"
                continue
            except httpx.TransportError as e:
                problem = f"could not be reached ({e.__class__.__name__}: {e})"
                continue
            if response.status_code in RETRIED_STATUS:
                problem = f"answered {response.status_code}: {response.text[:300]!r}"
                continue
            if response.status_code != 200:
                raise ModelRewardError(f"judge endpoint {url} answered {response.status_code}: "
                                       f"{response.text[:300]!r}; check kwargs.model ({self.model!r}) "
                                       f"and the server")
            return reply_text(response, url), attempt + 1
        tries = self.retries + 1
        raise ModelRewardError(f"judge endpoint {url} {problem} ({tries} {'try' if tries == 1 else 'tries'})"
                               "; start the server there, fix kwargs.endpoint, or raise kwargs.timeout / "
                               "kwargs.retries")


def reply_text(response, url: str) -> str:
    """The first choice's message text of a chat completions answer, or ModelRewardError quoting what came."""
    try:
        content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ModelRewardError(f"judge endpoint {url} answered {response.text[:300]!r}, not an OpenAI chat "
                               "completion (choices[0].message.content); is it an OpenAI-compatible "
                               "server?") from None
    return content if isinstance(content, str) else ""
