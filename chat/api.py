"""The JSON API (`/api/...`, session or API key) and the OpenAI-compatible `/v1/...` (API keys only).

Views parse, authenticate and call one service. Errors always come back as JSON in OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`, on both surfaces. See docs/api.md.
"""
import functools
import json


from channels.db import database_sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import transaction
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from . import ratelimit, services
from .auth import AuthFailed, authenticate
from .models import Turn

# Errors
# ------------------------------------------------------------------------------

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_response(status, message, *, code=None, param=None, retry_after=None):
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}
    response = JsonResponse(body, status=status)
    if retry_after is not None:
        response["Retry-After"] = str(int(retry_after))
    return response


def _chat_error_response(exc):
    return error_response(
        exc.status, exc.message, code=exc.code, param=exc.param, retry_after=getattr(exc, "retry_after", None)
    )


def _parse_json(request):
    try:
        raw = request.body
    except RequestDataTooBig:
        raise services.TooLarge(f"The request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.") from None
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested too deeply
        raise services.InvalidInput("The body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise services.InvalidInput("The body must be a JSON object.")
    return data


def api_view(methods, *, session=True):
    """Wrap a JSON view: method check, auth (session+CSRF or API key), body parsing, error mapping.

    The view is called as view(request, user, key, data, **kwargs).
    """

    def decorator(view):
        @csrf_exempt  # CSRF is enforced in authenticate() for session users only
        @functools.wraps(view)
        def wrapper(request, *args, **kwargs):
            if request.method not in methods:
                response = error_response(405, f"Method {request.method} is not allowed here.", code="method_not_allowed")
                response["Allow"] = ", ".join(methods)
                return response
            try:
                user, key = authenticate(request, allow_session=session)
            except AuthFailed as exc:
                code = "invalid_api_key" if exc.status == 401 else "csrf_failed"
                return error_response(exc.status, exc.message, code=code)
            try:
                data = _parse_json(request) if request.method in ("POST", "PATCH", "PUT") else {}
                return view(request, user, key, data, *args, **kwargs)
            except services.ChatError as exc:
                return _chat_error_response(exc)

        return wrapper

    return decorator


# /api: conversations
# ------------------------------------------------------------------------------


@api_view(["GET"])
def agents(request, user, key, data):
    return JsonResponse({"agents": [services.agent_payload(a) for a in services.visible_agents(user)]})


@api_view(["GET", "POST"])
def conversations(request, user, key, data):
    if request.method == "POST":
        agent = services.get_agent(user, _require_int(data, "agent_id"))
        conversation = services.create_conversation(user, agent, data.get("title", ""))
        return JsonResponse({"conversation": services.conversation_payload(conversation)}, status=201)
    agent = request.GET.get("agent") or None
    if agent is not None and not agent.isdigit():
        raise services.InvalidInput("'agent' must be an agent id.", param="agent")
    found = services.search_conversations(user, agent=int(agent) if agent else None, q=request.GET.get("q", ""))
    return JsonResponse({"conversations": [services.conversation_payload(c) for c in found[:200]]})


@api_view(["GET", "PATCH", "DELETE"])
def conversation_detail(request, user, key, data, conversation_id):
    conversation = services.get_conversation(user, conversation_id)
    if request.method == "PATCH":
        if "title" not in data:
            raise services.InvalidInput("Send {'title': ...} to rename.", param="title")
        services.rename_conversation(conversation, data["title"], user=user)
        return JsonResponse({"conversation": services.conversation_payload(conversation)})
    if request.method == "DELETE":
        services.delete_conversation(conversation, user=user)
        return HttpResponse(status=204)
    through = request.GET.get("turn")
    through_turn = services.get_turn(user, through) if through else None
    if through_turn is not None and through_turn.conversation_id != conversation.pk:
        raise services.NotFound("No such message.")
    turns = services.shown_branch(conversation, through=through_turn)
    return JsonResponse({"conversation": services.conversation_payload(conversation, turns=turns)})


def _require_int(data, name):
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise services.InvalidInput(f"'{name}' is required and must be an integer.", param=name)
    return value


# /api: feedback
# ------------------------------------------------------------------------------


def _check_feedback_rate(user, key):
    limit = ratelimit.feedback_limit()
    retry = ratelimit.hit("feedback", user.pk, limit)
    if retry is None and key is not None:
        retry = ratelimit.hit("feedback-key", key.pk, limit)
    if retry is not None:
        raise services.RateLimited(retry, f"Too much feedback at once; try again in {retry} s.")


@api_view(["POST"])
def turn_feedback(request, user, key, data, turn_id):
    turn = services.get_turn(user, turn_id)
    _check_feedback_rate(user, key)
    kind = data.get("kind")
    if not isinstance(kind, str):
        raise services.InvalidInput("'kind' is required: thumb_up, thumb_down, correction or comment.", param="kind")
    feedback = services.record_feedback(
        turn,
        user=user,
        kind=kind,
        reason=data.get("reason", ""),
        comment=data.get("comment", ""),
        corrected_text=data.get("corrected_text", ""),
    )
    return JsonResponse({"feedback": services.feedback_payload(feedback)}, status=201)


@api_view(["DELETE"])
def turn_thumb(request, user, key, data, turn_id):
    turn = services.get_turn(user, turn_id)
    withdrawn = services.withdraw_thumb(turn, user)
    return JsonResponse(
        {"withdrawn": withdrawn is not None, "feedback": services.feedback_payload(withdrawn) if withdrawn else None}
    )


# /v1: OpenAI-compatible
# ------------------------------------------------------------------------------

_ROLES = {"system", "user", "assistant", "tool"}


@api_view(["GET"], session=False)
def v1_models(request, user, key, data):
    own, shared, seen = [], [], set()
    for agent in services.visible_agents(user).order_by("name"):
        (own if agent.owner_id == user.pk else shared).append(agent)
    models = []
    for agent in own + shared:  # the user's own agent shadows a global one with the same slug
        if agent.slug in seen:
            continue
        seen.add(agent.slug)
        models.append(
            {
                "id": agent.slug,
                "object": "model",
                "created": int(agent.created_at.timestamp()),
                "owned_by": "you" if agent.owner_id else "platform",
                "name": agent.name,
            }
        )
    return JsonResponse({"object": "list", "data": models})


def _message_text(content, index):
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise services.InvalidInput(f"messages[{index}].content: only text parts are supported.", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise services.InvalidInput(f"messages[{index}].content must be a string or a list of text parts.", param="messages")


def _number(body, name, *, low, high, integer=False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise services.InvalidInput(f"'{name}' must be {kind} between {low} and {high}.", param=name)
    return value


def parse_completion_request(body):
    """Validate a /v1/chat/completions body; returns (model, messages, sampling, stream, include_usage)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise services.InvalidInput("'model' is required: an agent slug from GET /v1/models.", param="model")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise services.InvalidInput("'messages' must be a non-empty list.", param="messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise services.InvalidInput(f"messages[{i}] needs a role among {sorted(_ROLES)}.", param="messages")
        messages.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
    if messages[-1]["role"] not in ("user", "tool"):
        raise services.InvalidInput("The last message must be from the user or a tool.", param="messages")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise services.InvalidInput("'stop' must be a string or a list of strings.", param="stop")
    sampling = {
        "temperature": _number(body, "temperature", low=0, high=2),
        "top_p": _number(body, "top_p", low=0.0001, high=1),
        "max_tokens": _number(body, "max_completion_tokens", low=1, high=1 << 20, integer=True)
        or _number(body, "max_tokens", low=1, high=1 << 20, integer=True),
        "seed": _number(body, "seed", low=-(1 << 63), high=(1 << 63) - 1, integer=True),
        "stop": stop,
    }
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise services.InvalidInput("'stream' must be true or false.", param="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    return model, messages, sampling, stream, include_usage


def _session_headers(request):
    session_key = request.headers.get("X-Session-Id", "").strip() or None
    if session_key is not None and len(session_key) > 200:
        raise services.InvalidInput("X-Session-Id is longer than 200 characters.", param="X-Session-Id")
    turn_type = request.headers.get("X-Turn-Type", "main").strip().lower() or "main"
    if turn_type not in (Turn.TurnType.MAIN, Turn.TurnType.SIDE):
        raise services.InvalidInput("X-Turn-Type must be 'main' or 'side'.", param="X-Turn-Type")
    done = request.headers.get("X-Session-Done", "").strip().lower() in {"1", "true", "yes", "on"}
    return session_key, turn_type, done


def _failure_response(reply):
    failure = getattr(reply, "failure", "error")
    if failure == "unavailable":
        return error_response(503, reply.error, code="inference_unavailable")
    if failure == "context":
        return error_response(400, reply.error, code="context_length_exceeded", param="messages")
    return error_response(502, reply.error or "Generation failed.", code="inference_error")


def _completion_id(reply):
    return f"chatcmpl-{reply.pk}"


def _usage(reply):
    prompt = len(reply.prompt_token_ids or [])
    completion = len(reply.token_ids or [])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(reply):
    return (reply.sampling_params or {}).get("finish_reason") or ("stop" if reply.status == Turn.Status.COMPLETE else "length")


def _with_turn_header(response, reply):
    response["X-Turn-Id"] = str(reply.pk)
    return response


@csrf_exempt
@transaction.non_atomic_requests  # streaming outlives the request transaction; services commit themselves
async def v1_chat_completions(request):
    if request.method != "POST":
        return error_response(405, "Use POST.", code="method_not_allowed")
    try:
        user, key = await database_sync_to_async(authenticate)(request, allow_session=False)
    except AuthFailed as exc:
        return error_response(401, exc.message, code="invalid_api_key")
    try:
        body = _parse_json(request)
        model, messages, sampling, stream, include_usage = parse_completion_request(body)
        session_key, turn_type, done = _session_headers(request)
        agent = await database_sync_to_async(services.agent_for_model)(user, model)
        retry = await ratelimit.ahit("messages", user.pk, ratelimit.message_limit())
        if retry is not None:
            raise services.RateLimited(retry)
        conversation, parent = await services.aingest_history(
            user, agent, messages, session_key=session_key, turn_type=turn_type, done=done
        )
    except services.ChatError as exc:
        return _chat_error_response(exc)

    events = services.agenerate_reply(parent, sampling=sampling, turn_type=turn_type)
    if not stream:
        reply = None
        async for event in events:
            reply = event.turn or reply
        if reply.status == Turn.Status.FAILED:
            return _with_turn_header(_failure_response(reply), reply)
        payload = {
            "id": _completion_id(reply),
            "object": "chat.completion",
            "created": int(reply.created_at.timestamp()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.content},
                    "logprobs": None,
                    "finish_reason": _finish_reason(reply),
                }
            ],
            "usage": _usage(reply),
            "turn_id": reply.pk,
        }
        return _with_turn_header(JsonResponse(payload), reply)

    # Streaming: wait for the first text (or the end) so a dead engine still gets a proper 503.
    buffered = []
    reply = None
    async for event in events:
        reply = event.turn or reply
        if event.kind != "started":
            buffered.append(event)
            break
    if buffered and buffered[0].kind == "done" and reply.status == Turn.Status.FAILED:
        return _with_turn_header(_failure_response(reply), reply)
    response = StreamingHttpResponse(
        _sse(events, buffered, reply, model, include_usage), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return _with_turn_header(response, reply)


def _chunk(reply, model, delta, finish_reason=None, **extra):
    return {
        "id": _completion_id(reply),
        "object": "chat.completion.chunk",
        "created": int(reply.created_at.timestamp()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}] if delta is not None else [],
        "turn_id": reply.pk,
        **extra,
    }


def _sse_line(data):
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _sse(events, buffered, reply, model, include_usage):
    yield _sse_line(_chunk(reply, model, {"role": "assistant", "content": ""}))

    async def all_events():
        for event in buffered:
            yield event
        async for event in events:
            yield event

    try:
        async for event in all_events():
            if event.kind == "delta":
                yield _sse_line(_chunk(reply, model, {"content": event.text}))
            elif event.kind == "done":
                reply = event.turn
                if reply.status == Turn.Status.FAILED:
                    status = 503 if getattr(reply, "failure", "") == "unavailable" else 502
                    yield _sse_line({"error": {"message": reply.error, "type": _TYPES.get(status), "param": None, "code": status}})
                else:
                    yield _sse_line(_chunk(reply, model, {}, _finish_reason(reply)))
                    if include_usage:
                        yield _sse_line(_chunk(reply, model, None, usage=_usage(reply)))
        yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()  # a client that hangs up stops the reply ("stopped", partial kept)


