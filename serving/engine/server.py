"""HTTP front of the built-in engine: vLLM's OpenAI-compatible routes on Starlette.

`OpenAIServing` holds the engine and turns wire requests into a response model, an
ErrorResponse or an async generator of SSE lines; it never touches HTTP. The routes below it
are thin: they map each of those to JSON with its status code or to `text/event-stream`.
"""
import json
import logging
import time
from http import HTTPStatus

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from serving.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    UnloadLoRAAdapterRequest,
    UsageInfo,
    error_response,
)

from .adapters import AdapterError
from .engine import AdapterNotFound, Engine

logger = logging.getLogger(__name__)


class OpenAIServing:
    """Chat completions, models and LoRA management over one Engine."""

    def __init__(self, engine: Engine, served_model_name: str):
        self.engine = engine
        self.served_model_name = served_model_name

    # ------------------------------------------------------------------ models and adapters

    def model_not_found(self, name):
        return error_response(f"The model `{name}` does not exist.", err_type="NotFoundError",
                              status_code=HTTPStatus.NOT_FOUND, param="model")

    def show_available_models(self):
        cards = [ModelCard(id=self.served_model_name, root=self.engine.model_dir,
                           max_model_len=self.engine.max_model_len, permission=[ModelPermission()])]
        cards += [ModelCard(id=record.name, root=record.path, parent=self.served_model_name,
                            permission=[ModelPermission()]) for record in self.engine.adapters()]
        return ModelList(data=cards)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest):
        if not request.lora_name or not request.lora_path:
            return error_response("Both 'lora_name' and 'lora_path' must be provided.", err_type="InvalidUserInput")
        if request.lora_name == self.served_model_name:
            return error_response(f"'{request.lora_name}' is the base model's name.", err_type="InvalidUserInput")
        try:
            await self.engine.add_adapter(request.lora_name, request.lora_path)
        except AdapterError as exc:
            return error_response(exc.message, err_type=exc.err_type, status_code=exc.status_code)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest):
        if not request.lora_name:
            return error_response("'lora_name' needs to be provided to unload a LoRA adapter.",
                                  err_type="InvalidUserInput")
        try:
            await self.engine.remove_adapter(request.lora_name)
        except AdapterNotFound:
            return error_response(f"The lora adapter '{request.lora_name}' cannot be found.",
                                  err_type="NotFoundError", status_code=HTTPStatus.NOT_FOUND)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    # ------------------------------------------------------------------ chat completions

    async def create_chat_completion(self, request: ChatCompletionRequest):
        """Return a ChatCompletionResponse, an ErrorResponse, or an async generator of SSE strings."""
        model = request.model or self.served_model_name
        if model == self.served_model_name:
            adapter = None
        elif self.engine.has_adapter(model):
            adapter = model
        else:
            return self.model_not_found(model)
        if (request.n or 1) != 1:
            return error_response("The built-in engine serves n=1 only.", param="n")
        if request.temperature is not None and request.temperature < 0:
            return error_response("temperature must be >= 0.", param="temperature")
        if request.top_p is not None and not 0 < request.top_p <= 1:
            return error_response("top_p must be in (0, 1].", param="top_p")
        params = request.to_sampling_params()
        if params.max_tokens is not None and params.max_tokens < 1:
            return error_response("max_tokens must be at least 1.", param="max_tokens")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            prompt_ids = self.engine.render_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                                 chat_template_kwargs=request.chat_template_kwargs)
        except Exception as exc:  # a template error is the caller's input problem
            return error_response(f"Cannot apply the chat template: {exc}", param="messages")
        error = self.engine.check_prompt(prompt_ids, params)
        if error:
            return error_response(error)
        outputs = self.engine.generate(prompt_ids, params, adapter=adapter, request_id=request.request_id)
        if request.stream:
            return self._stream(request, model, prompt_ids, outputs)
        return await self._full(request, model, prompt_ids, outputs)

    def _logprobs(self, token_ids, logprobs):
        content = []
        for token_id, logprob in zip(token_ids, logprobs):
            token = self.engine.tokenizer.decode([token_id])
            content.append(ChatCompletionLogProbsContent(token=token, logprob=logprob,
                                                         bytes=list(token.encode("utf-8"))))
        return ChatCompletionLogProbs(content=content)

    async def _full(self, request, model, prompt_ids, outputs):
        text, token_ids, logprobs, finish, stop_reason = [], [], [], None, None
        try:
            async for out in outputs:
                text.append(out.text)
                token_ids += out.token_ids
                logprobs += out.logprobs
                finish, stop_reason = out.finish_reason, out.stop_reason
        except AdapterNotFound:
            return self.model_not_found(model)
        except Exception as exc:
            return error_response(str(exc), err_type="InternalServerError",
                                  status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
        choice = ChatCompletionResponseChoice(
            index=0, message=ChatMessage(role="assistant", content="".join(text)),
            logprobs=self._logprobs(token_ids, logprobs) if request.logprobs else None,
            finish_reason=finish, stop_reason=stop_reason,
            token_ids=token_ids if request.return_token_ids else None)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids),
                          total_tokens=len(prompt_ids) + len(token_ids))
        return ChatCompletionResponse(id=f"chatcmpl-{request.request_id}", model=model, choices=[choice],
                                      usage=usage,
                                      prompt_token_ids=prompt_ids if request.return_token_ids else None)

    async def _stream(self, request, model, prompt_ids, outputs):
        response_id, created = f"chatcmpl-{request.request_id}", int(time.time())

        def chunk(choices, **extra):
            body = ChatCompletionStreamResponse(id=response_id, created=created, model=model, choices=choices,
                                                **extra).model_dump(exclude_none=True)
            for choice in body["choices"]:
                choice.setdefault("finish_reason", None)  # OpenAI sends it as null until the end
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        first = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
        if request.return_token_ids:
            yield chunk([first], prompt_token_ids=prompt_ids)
        else:
            yield chunk([first])
        completion_tokens = 0
        try:
            async for out in outputs:
                completion_tokens += len(out.token_ids)
                fields = {"index": 0, "delta": DeltaMessage(content=out.text)}
                if request.logprobs:
                    fields["logprobs"] = self._logprobs(out.token_ids, out.logprobs)
                if request.return_token_ids:
                    fields["token_ids"] = out.token_ids
                if out.finish_reason is not None:
                    fields.update(finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                yield chunk([ChatCompletionResponseStreamChoice(**fields)])
        except Exception as exc:
            # the status line is gone already: report the error in-band, as vLLM does
            error = error_response(str(exc), err_type="InternalServerError",
                                   status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
            yield f"data: {error.model_dump_json()}\n\n"
        if request.stream_options and request.stream_options.include_usage:
            usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens,
                              total_tokens=len(prompt_ids) + completion_tokens)
            yield chunk([], usage=usage)
        yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------- routes


def _error_json(error: ErrorResponse):
    return JSONResponse(error.model_dump(), status_code=error.error.code)


async def _parse(request: Request, model):
    try:
        return model.model_validate(json.loads(await request.body()))
    except (ValueError, ValidationError) as exc:
        # ValidationError is a ValueError; both mean the body is not a valid request
        return error_response(f"Invalid request body: {exc}")


async def chat_completions(request: Request):
    parsed = await _parse(request, ChatCompletionRequest)
    if isinstance(parsed, ErrorResponse):
        return _error_json(parsed)
    result = await request.app.state.serving.create_chat_completion(parsed)
    if isinstance(result, ErrorResponse):
        return _error_json(result)
    if isinstance(result, ChatCompletionResponse):
        return JSONResponse(result.model_dump(exclude_none=False))
    return StreamingResponse(result, media_type="text/event-stream")


async def list_models(request: Request):
    return JSONResponse(request.app.state.serving.show_available_models().model_dump())


async def load_lora_adapter(request: Request):
    parsed = await _parse(request, LoadLoRAAdapterRequest)
    if not isinstance(parsed, ErrorResponse):
        parsed = await request.app.state.serving.load_lora_adapter(parsed)
    if isinstance(parsed, ErrorResponse):
        return _error_json(parsed)
    return PlainTextResponse(parsed)


async def unload_lora_adapter(request: Request):
    parsed = await _parse(request, UnloadLoRAAdapterRequest)
    if not isinstance(parsed, ErrorResponse):
        parsed = await request.app.state.serving.unload_lora_adapter(parsed)
    if isinstance(parsed, ErrorResponse):
        return _error_json(parsed)
    return PlainTextResponse(parsed)


async def health(request: Request):
    return Response(status_code=200)


async def metrics(request: Request):
    stats = request.app.state.serving.engine.stats()
    lines = []
    for key, value in stats.items():
        lines += [f"# TYPE claw_engine_{key} gauge", f"claw_engine_{key} {value}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def build_app(engine: Engine, served_model_name: str):
    """The Starlette app; the engine's model thread runs for the app's lifetime."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.serving = OpenAIServing(engine, served_model_name)
    return app
