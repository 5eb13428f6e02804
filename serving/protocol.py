"""Wire models of the subset of vLLM's OpenAI-compatible API that the platform speaks.

Shapes follow vllm-project/vllm `vllm/entrypoints/openai/chat_completion/protocol.py`,
`.../engine/protocol.py` and `.../serve/lora/protocol.py`, so that the client works against
vLLM and against the built-in engine (`manage.py serve_model`) alike. Both sides import this
module; it holds pydantic models only.
"""
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)


def random_uuid():
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Accepts unknown fields, as vLLM does, and logs the ones it ignores."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data, handler):
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            ignored = set(data) - known
            if ignored:
                logger.warning("The following fields were present in the request but ignored: %s", ignored)
        return result


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


def error_response(message, *, err_type="BadRequestError", status_code=400, param=None):
    """Build vLLM's error body; `code` carries the HTTP status, as vLLM's does."""
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=int(status_code)))


# ---------------------------------------------------------------------------
# Chat completions: request
# ---------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self):
        """The text of the message; OpenAI's list-of-parts form is flattened to its text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type", "text") == "text")


@dataclass
class SamplingParams:
    """What the engine needs to sample one completion."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: up to the end of the context, as vLLM does
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False


class ChatCompletionRequest(OpenAIBaseModel):
    # Ordered by official OpenAI API documentation
    # https://platform.openai.com/docs/api-reference/chat/create
    messages: list[ChatMessageParam]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None

    # vLLM-specific parameters that are not in the OpenAI spec
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    request_id: str = Field(default_factory=random_uuid)
    return_token_ids: bool | None = None

    def to_sampling_params(self, *, default_max_tokens=None):
        """Translate the wire request into engine parameters (vLLM's defaults: temperature 1, top_p 1)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            seed=self.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=bool(self.logprobs),
        )


# ---------------------------------------------------------------------------
# Chat completions: response and stream chunks
# ---------------------------------------------------------------------------


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    # not part of the OpenAI spec but included in vLLM for legacy reasons
    stop_reason: int | str | None = None
    # vLLM: the generated token ids, when the request sets return_token_ids
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo

    # vLLM-specific fields that are not in OpenAI spec
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM: the token ids this chunk carries, when the request sets return_token_ids
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    # vLLM: set on the first chunk when the request sets return_token_ids
    prompt_token_ids: list[int] | None = None


# ---------------------------------------------------------------------------
# Models and LoRA adapters
# ---------------------------------------------------------------------------


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str
    # vLLM extra; the built-in engine never reloads a name in place and refuses it
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = Field(default=None)
