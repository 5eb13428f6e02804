"""The inference client: one async interface over one or more vLLM-protocol endpoints.

It speaks the subset of vLLM's OpenAI-compatible server described in docs/serving.md, so the
same code drives vLLM replicas on GPUs and the built-in engine (`manage.py serve_model`).

Scale-out: each request goes to the replica that rendezvous hashing picks for its affinity key
(the user key if given, else the adapter name), so one user's requests stay where their adapter
is already resident; a replica that refuses connections or answers 503 is skipped for a few
seconds and the next one in the key's order takes the request. A replica that answers "model
does not exist" for an adapter (it restarted and lost its adapters) is handed to the
`on_missing_adapter` callback, which reloads it from the store, and the request is retried once.

The client never touches the database: the reload callback lives in `serving.services`.
Requests are built from `serving.protocol`'s models; responses are read as plain JSON, because
vLLM's carry fields our models don't list (`system_fingerprint`, `kv_transfer_params`, ...).
"""
import asyncio
import contextvars
import hashlib
import itertools
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from django.conf import settings

from serving import protocol

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 2.0
# How long a replica that refused a connection (or said 503) goes to the back of the line.
DOWN_FOR_S = 5.0

# Set by the sync twins: a client private to one asyncio.run(), closed with it.
_http_override: contextvars.ContextVar = contextvars.ContextVar("serving_http_override", default=None)


class InferenceFailure(Exception):
    """Base class: inference did not produce a reply."""

    def __init__(self, message, *, status_code=None, error_type=None, url=None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.url = url


class InferenceUnavailable(InferenceFailure):
    """No replica could be reached (connection refused, timeout) or every one answered 503."""


class InferenceError(InferenceFailure):
    """A replica answered with an error (4xx/5xx other than 503); `message` is the server's."""


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: list[str] | None = None


@dataclass
class StreamEvent:
    """One streamed delta. `logprobs[i]` is the raw logprob of `token_ids[i]`."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    adapter: str | None


# (client, url, adapter name) -> True if the adapter is now loaded on that replica.
MissingAdapterCallback = Callable[["InferenceClient", str, str], Awaitable[bool]]


def _error_from(response, url):
    """Build the exception for an error response; vLLM's shape is {"error": {message, type, ...}}."""
    message, error_type = None, None
    try:
        payload = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        payload = None
    if isinstance(payload, dict):
        info = payload.get("error") if isinstance(payload.get("error"), dict) else payload
        message = info.get("message") or (payload.get("detail") if isinstance(payload.get("detail"), str) else None)
        error_type = info.get("type")
    if not message:
        message = response.text.strip()[:500] or f"HTTP {response.status_code}"
    cls = InferenceUnavailable if response.status_code == 503 else InferenceError
    return cls(message, status_code=response.status_code, error_type=error_type, url=url)


def _is_missing_model(error):
    return error.status_code == 404 and (error.error_type == "NotFoundError" or "does not exist" in error.message)


def _token_logprobs(logprobs):
    if not logprobs:
        return []
    return [float(item["logprob"]) for item in logprobs.get("content") or []]


class InferenceClient:
    """Async client for vLLM-protocol replicas (`INFERENCE_URLS`), with sync twins for Celery."""

    def __init__(self, urls, *, base_model, timeout=120.0, on_missing_adapter: MissingAdapterCallback | None = None):
        if not urls:
            raise ValueError("InferenceClient needs at least one URL.")
        self.urls = [u.rstrip("/") for u in urls]
        self.base_model = base_model
        self.timeout = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S)
        self.on_missing_adapter = on_missing_adapter
        self._down_until: dict[str, float] = {}
        self._round_robin = itertools.count()
        # An httpx.AsyncClient belongs to the event loop it was first used on.
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- plumbing -----------------------------------------------------------------

    def _new_http(self):
        return httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    def _http(self):
        override = _http_override.get()
        if override is not None:
            return override
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = self._clients[loop] = self._new_http()
        return client

    async def aclose(self):
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()

    def _run_sync(self, method, *args, **kwargs):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(f"{method.__name__}_sync was called inside an event loop; await {method.__name__} instead.")

        async def run():
            async with self._new_http() as http:
                token = _http_override.set(http)
                try:
                    return await method(*args, **kwargs)
                finally:
                    _http_override.reset(token)

        return asyncio.run(run())

    def replica_order(self, key=None):
        """Replicas in the order a request with affinity `key` tries them.

        Rendezvous (highest-random-weight) hashing: each key ranks the replicas by
        sha256(key|url), so adding or removing a replica moves only the keys it wins or loses.
        Without a key, requests go round-robin. Replicas recently found down go last.
        """
        urls = self.urls
        if key is None:
            start = next(self._round_robin) % len(urls)
            order = urls[start:] + urls[:start]
        else:
            order = sorted(urls, key=lambda u: hashlib.sha256(f"{key}|{u}".encode()).digest(), reverse=True)
        now = time.monotonic()
        return sorted(order, key=lambda u: self._down_until.get(u, 0.0) > now)

    def _mark_down(self, url):
        self._down_until[url] = time.monotonic() + DOWN_FOR_S

    async def _send(self, path, body, *, key, adapter=None, stream=False):
        """POST `body` with failover; returns (url, response) with status 200, still open."""
        http = self._http()
        last = None
        for url in self.replica_order(key):
            restored = False
            while True:
                request = http.build_request("POST", url + path, json=body)
                try:
                    response = await http.send(request, stream=stream)
                except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                        httpx.PoolTimeout) as exc:
                    # Nothing was generated yet: safe to send it to the next replica.
                    self._mark_down(url)
                    last = InferenceUnavailable(f"Inference server unreachable: {type(exc).__name__}", url=url)
                    logger.warning("Replica %s unreachable (%s); trying the next one", url, type(exc).__name__)
                    break
                except httpx.TimeoutException as exc:
                    raise InferenceUnavailable(f"Inference server timed out: {type(exc).__name__}", url=url) from exc
                if response.status_code == 200:
                    return url, response
                await response.aread()
                await response.aclose()
                error = _error_from(response, url)
                if isinstance(error, InferenceUnavailable):
                    self._mark_down(url)
                    last = error
                    break
                if adapter and not restored and self.on_missing_adapter is not None and _is_missing_model(error):
                    restored = True
                    logger.warning("Replica %s lacks adapter %s; reloading it from the store", url, adapter)
                    if await self.on_missing_adapter(self, url, adapter):
                        continue
                raise error
        raise last or InferenceUnavailable("No inference replica answered.")

    def _chat_body(self, messages, adapter, params, *, stream):
        params = params or SamplingParams()
        request = protocol.ChatCompletionRequest(
            messages=list(messages),
            model=adapter or self.base_model,
            logprobs=True,
            max_tokens=params.max_tokens,
            seed=params.seed,
            stop=list(params.stop) if params.stop else None,
            stream=stream,
            stream_options=protocol.StreamOptions(include_usage=True) if stream else None,
            temperature=params.temperature,
            top_p=params.top_p,
            # vLLM extra: token ids of the prompt and of every generated token.
            return_token_ids=True,
        )
        return request.model_dump(mode="json", exclude_none=True)

    # -- chat -----------------------------------------------------------------------

    async def stream_chat(self, messages, *, adapter=None, params=None, affinity_key=None) -> AsyncIterator[StreamEvent]:
        """Stream a chat completion from the base model or `adapter`.

        Args:
            messages: OpenAI chat messages, [{"role": ..., "content": ...}, ...].
            adapter: a loaded adapter's name (`u<user>-a<agent>-v<n>`), or None for the base model.
            params: SamplingParams.
            affinity_key: keeps requests with the same key on the same replica (e.g. "user-12").

        Yields:
            StreamEvent per delta; the first carries `prompt_token_ids`, the last `finish_reason`.
        """
        body = self._chat_body(messages, adapter, params, stream=True)
        url, response = await self._send("/v1/chat/completions", body, key=affinity_key or adapter, adapter=adapter, stream=True)
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    info = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    raise InferenceError(info.get("message", "stream error"), status_code=info.get("code"),
                                         error_type=info.get("type"), url=url)
                prompt_token_ids = chunk.get("prompt_token_ids")
                for choice in chunk.get("choices") or []:
                    event = StreamEvent(
                        text=(choice.get("delta") or {}).get("content") or "",
                        token_ids=list(choice.get("token_ids") or []),
                        logprobs=_token_logprobs(choice.get("logprobs")),
                        finish_reason=choice.get("finish_reason"),
                        prompt_token_ids=prompt_token_ids,
                    )
                    prompt_token_ids = None
                    if event.text or event.token_ids or event.finish_reason or event.prompt_token_ids is not None:
                        yield event
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise InferenceUnavailable(f"Inference stream broke off: {type(exc).__name__}", url=url) from exc
        finally:
            await response.aclose()

    async def chat(self, messages, *, adapter=None, params=None, affinity_key=None) -> Completion:
        """Non-streaming chat completion; same arguments as `stream_chat`."""
        body = self._chat_body(messages, adapter, params, stream=False)
        url, response = await self._send("/v1/chat/completions", body, key=affinity_key or adapter, adapter=adapter)
        try:
            payload = response.json()
        finally:
            await response.aclose()
        choice = payload["choices"][0]
        return Completion(
            text=(choice.get("message") or {}).get("content") or "",
            token_ids=list(choice.get("token_ids") or []),
            logprobs=_token_logprobs(choice.get("logprobs")),
            prompt_token_ids=payload.get("prompt_token_ids"),
            finish_reason=choice.get("finish_reason"),
            adapter=adapter,
        )

    def chat_sync(self, messages, *, adapter=None, params=None, affinity_key=None) -> Completion:
        """`chat` for sync code (Celery tasks). Not callable from inside an event loop."""
        return self._run_sync(self.chat, messages, adapter=adapter, params=params, affinity_key=affinity_key)

    # -- adapters -------------------------------------------------------------------

    async def _load_one(self, url, name, path):
        """Load on one replica. Returns True if loaded now, False if it already held the name."""
        body = protocol.LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path)).model_dump(exclude_none=True)
        try:
            response = await self._http().post(url + "/v1/load_lora_adapter", json=body)
        except httpx.TransportError as exc:
            raise InferenceUnavailable(f"Inference server unreachable: {type(exc).__name__}", url=url) from exc
        if response.status_code == 200:
            return True
        error = _error_from(response, url)
        # A name always means the same files (versions are never rewritten), so "already loaded"
        # is success. We never ask for load_inplace.
        if response.status_code == 400 and "already been loaded" in error.message:
            return False
        raise error

    async def load_adapter(self, name, path, *, urls=None):
        """Load adapter `name` from `path` on every replica (or on `urls`), all or nothing.

        If any replica fails, the replicas that loaded it during this call unload it again and the
        first error is raised (InferenceUnavailable or InferenceError).
        """
        targets = [u.rstrip("/") for u in urls] if urls is not None else self.urls
        results = await asyncio.gather(*(self._load_one(u, name, path) for u in targets), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            newly = [u for u, r in zip(targets, results) if r is True]
            if newly:
                await self.unload_adapter(name, urls=newly)
            raise failures[0]
        logger.info("Loaded adapter %s on %d replica(s)", name, len(targets))

    async def _unload_one(self, url, name):
        try:
            response = await self._http().post(url + "/v1/unload_lora_adapter", json=protocol.UnloadLoRAAdapterRequest(lora_name=name).model_dump(exclude_none=True))
        except httpx.TransportError as exc:
            logger.warning("Could not unload %s from %s: %s", name, url, type(exc).__name__)
            return False
        if response.status_code == 200:
            return True
        if response.status_code != 404:
            logger.warning("Unloading %s from %s failed: %s", name, url, _error_from(response, url).message)
        return False

    async def unload_adapter(self, name, *, urls=None):
        """Unload `name` from every replica (or `urls`), best effort. Returns {url: unloaded}."""
        targets = [u.rstrip("/") for u in urls] if urls is not None else self.urls
        results = await asyncio.gather(*(self._unload_one(u, name) for u in targets))
        return dict(zip(targets, results))

    def load_adapter_sync(self, name, path, *, urls=None):
        return self._run_sync(self.load_adapter, name, path, urls=urls)

    def unload_adapter_sync(self, name, *, urls=None):
        return self._run_sync(self.unload_adapter, name, urls=urls)

    # -- health -----------------------------------------------------------------------

    async def _models_of(self, url, timeout):
        response = await self._http().get(url + "/v1/models", timeout=timeout)
        if response.status_code != 200:
            raise _error_from(response, url)
        return response.json().get("data") or []

    async def _health_one(self, url, timeout):
        try:
            response = await self._http().get(url + "/health", timeout=timeout)
            if response.status_code != 200:
                return {"ok": False, "adapters": [], "error": f"HTTP {response.status_code}"}
            models = await self._models_of(url, timeout)
        except (httpx.HTTPError, InferenceFailure) as exc:
            return {"ok": False, "adapters": [], "error": type(exc).__name__}
        adapters = sorted(m["id"] for m in models if m.get("id") != self.base_model)
        return {"ok": True, "adapters": adapters, "error": None}

    async def health(self, *, timeout=HEALTH_TIMEOUT_S):
        """{url: {"ok": bool, "adapters": [loaded adapter names], "error": str | None}}."""
        results = await asyncio.gather(*(self._health_one(u, timeout) for u in self.urls))
        return dict(zip(self.urls, results))

    def health_sync(self, *, timeout=HEALTH_TIMEOUT_S):
        return self._run_sync(self.health, timeout=timeout)

    async def list_models(self, *, url=None):
        """The model cards (`GET /v1/models` data) of `url`, or of the first replica that answers."""
        last = None
        for candidate in [url.rstrip("/")] if url else self.replica_order():
            try:
                return await self._models_of(candidate, self.timeout)
            except httpx.TransportError as exc:
                last = InferenceUnavailable(f"Inference server unreachable: {type(exc).__name__}", url=candidate)
        raise last

    def list_models_sync(self, *, url=None):
        return self._run_sync(self.list_models, url=url)


_shared: dict = {}


def get_client() -> InferenceClient:
    """The process's shared client for `settings.INFERENCE_URLS` (rebuilt if the settings change)."""
    key = (tuple(settings.INFERENCE_URLS), settings.SERVED_MODEL_NAME, settings.INFERENCE_TIMEOUT)
    client = _shared.get(key)
    if client is None:
        # The reload-on-404 callback reads the registry, so it lives in services (DB-free client).
        from serving.services import arestore_adapter

        client = InferenceClient(
            settings.INFERENCE_URLS,
            base_model=settings.SERVED_MODEL_NAME,
            timeout=settings.INFERENCE_TIMEOUT,
            on_missing_adapter=arestore_adapter,
        )
        _shared.clear()
        _shared[key] = client
    return client
