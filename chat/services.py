"""Chat verbs: conversations, messages, replies and feedback.

Views, consumers and the /v1 API stay thin and call these. Every verb that takes a user checks
that the conversation or turn is theirs and raises `NotFound` otherwise, so a stranger's id
looks exactly like a missing one. Async twins (`a` prefix) serve the consumers.
"""
import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from . import context as chat_context
from .models import Agent, Conversation, Feedback, Turn

logger = logging.getLogger(__name__)


# Errors
# ------------------------------------------------------------------------------


class ChatError(Exception):
    """A request we refuse, with a short machine code and a message for people."""

    code = "invalid"
    status = 400

    def __init__(self, message, *, param=None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidInput(ChatError):
    code = "invalid"
    status = 400


class NotFound(ChatError):
    code = "not_found"
    status = 404

    def __init__(self, message="Not found.", **kwargs):
        super().__init__(message, **kwargs)


class TooLarge(ChatError):
    code = "too_large"
    status = 413


class RateLimited(ChatError):
    code = "rate_limited"
    status = 429

    def __init__(self, retry_after, message=None):
        self.retry_after = int(retry_after)
        super().__init__(message or f"Too many requests; try again in {self.retry_after} s.")


def user_group(user_id):
    """Channel-layer group of every socket of one user (job progress, version pushes)."""
    return f"user_{user_id}"


# Lookups with ownership
# ------------------------------------------------------------------------------


def visible_agents(user):
    return Agent.objects.visible_to(user)


def get_agent(user, agent_id):
    try:
        return visible_agents(user).get(pk=int(agent_id))
    except (Agent.DoesNotExist, TypeError, ValueError):
        raise NotFound("No such agent.") from None


def agent_for_model(user, slug):
    """The agent a /v1 `model` names: the user's own agent with that slug first, then a global one."""
    agents = list(visible_agents(user).filter(slug=slug))
    agents.sort(key=lambda a: a.owner_id is None)
    if not agents:
        raise NotFound(f"The model '{slug}' does not exist.", param="model")
    return agents[0]


def get_conversation(user, conversation_id):
    try:
        return Conversation.objects.select_related("agent").get(pk=int(conversation_id), user_id=user.pk)
    except (Conversation.DoesNotExist, TypeError, ValueError):
        raise NotFound("No such conversation.") from None


def get_turn(user, turn_id):
    try:
        return Turn.objects.select_related("conversation__agent").get(pk=int(turn_id), conversation__user_id=user.pk)
    except (Turn.DoesNotExist, TypeError, ValueError):
        raise NotFound("No such message.") from None


def _check_owner(conversation, user):
    if user is None or conversation.user_id != user.pk:
        raise NotFound("No such conversation.")


aget_agent = database_sync_to_async(get_agent)
aget_conversation = database_sync_to_async(get_conversation)
aget_turn = database_sync_to_async(get_turn)


# Conversations
# ------------------------------------------------------------------------------


def create_conversation(user, agent, title="", *, source=Conversation.Source.WEB, session_key=""):
    if agent.owner_id is not None and agent.owner_id != user.pk:
        raise NotFound("No such agent.")
    title = _clean_title(title)
    return Conversation.objects.create(user=user, agent=agent, title=title, source=source, session_key=session_key)


def _clean_title(title):
    if not isinstance(title, str):
        raise InvalidInput("The title must be a string.", param="title")
    title = " ".join(title.split())
    if len(title) > 200:
        raise InvalidInput("The title is longer than 200 characters.", param="title")
    return title


def rename_conversation(conversation, title, *, user):
    _check_owner(conversation, user)
    conversation.title = _clean_title(title)
    conversation.save(update_fields=["title", "updated_at"])
    return conversation


def delete_conversation(conversation, *, user):
    _check_owner(conversation, user)
    conversation.delete()


def search_conversations(user, agent=None, q=""):
    """The user's conversations, newest first, filtered by agent and by text in the title or turns."""
    qs = Conversation.objects.filter(user_id=user.pk).select_related("agent")
    if agent is not None:
        qs = qs.filter(agent_id=getattr(agent, "pk", agent))
    q = (q or "").strip()
    if q:
        matching = Turn.objects.filter(conversation__user_id=user.pk, content__icontains=q).values("conversation_id")
        qs = qs.filter(Q(title__icontains=q) | Q(pk__in=matching))
    return qs.order_by("-updated_at", "-pk")


acreate_conversation = database_sync_to_async(create_conversation)


# Branches
# ------------------------------------------------------------------------------


def _children_map(turns):
    children = {}
    for turn in turns:
        children.setdefault(turn.parent_id, []).append(turn)
    for kids in children.values():
        kids.sort(key=lambda t: (t.created_at, t.pk))
    return children


def _latest(kids):
    # The UI shows the main line; a side turn is shown only when nothing else is there.
    main = [t for t in kids if t.turn_type == Turn.TurnType.MAIN]
    return (main or kids)[-1]


def _annotate_siblings(turn, kids):
    turn.sibling_ids = [t.pk for t in kids]
    turn.sibling_position = turn.sibling_ids.index(turn.pk) + 1


def shown_branch(conversation, *, through=None):
    """The turns the UI shows: the latest child at each level (or the branch through `through`).

    Each turn gets `sibling_ids` and `sibling_position` (1-based) for the "< 2/3 >" switcher.
    """
    turns = list(conversation.turns.all())
    by_id = {t.pk: t for t in turns}
    children = _children_map(turns)
    forced = {}
    if through is not None and through.pk in by_id:
        node = by_id[through.pk]
        while node is not None:
            forced[node.parent_id] = node
            node = by_id.get(node.parent_id)
    branch, parent_id = [], None
    while children.get(parent_id):
        kids = children[parent_id]
        turn = forced.get(parent_id) or _latest(kids)
        _annotate_siblings(turn, kids)
        branch.append(turn)
        parent_id = turn.pk
    return branch


def ancestors(turn):
    """The chain from the root to `turn`, inclusive, oldest first."""
    turns = {t.pk: t for t in Turn.objects.filter(conversation_id=turn.conversation_id)}
    chain, node = [], turns.get(turn.pk, turn)
    while node is not None:
        chain.append(node)
        node = turns.get(node.parent_id)
    chain.reverse()
    return chain


def sibling_info(turn):
    ids = list(
        Turn.objects.filter(conversation_id=turn.conversation_id, parent_id=turn.parent_id)
        .order_by("created_at", "pk")
        .values_list("pk", flat=True)
    )
    return {"ids": ids, "count": len(ids), "position": ids.index(turn.pk) + 1 if turn.pk in ids else None}


ashown_branch = database_sync_to_async(shown_branch)


# Messages
# ------------------------------------------------------------------------------


def validate_message(agent, content, *, role=Turn.Role.USER):
    """Check a new message before anything is saved: type, emptiness, size and context fit."""
    if not isinstance(content, str):
        raise InvalidInput("The message must be a string.", param="content")
    if not content.strip():
        raise InvalidInput("The message is empty.", param="content")
    if len(content) > settings.MAX_MESSAGE_CHARS:
        raise TooLarge(
            f"The message is {len(content)} characters; the limit is {settings.MAX_MESSAGE_CHARS}.", param="content"
        )
    try:
        chat_context.check_message_fits(agent, content, role=role)
    except chat_context.ContextTooLong as exc:
        raise TooLarge(str(exc), param="content") from None


avalidate_message = database_sync_to_async(validate_message)


def _record_next_state(reply, next_turn, user):
    """The message after a reply is that reply's next state: store it as implicit feedback.

    Training picks it up through its own post_save receiver. Side turns give no signal.
    """
    if (
        reply is None
        or reply.role != Turn.Role.ASSISTANT
        or reply.status not in (Turn.Status.COMPLETE, Turn.Status.STOPPED)
        or reply.turn_type != Turn.TurnType.MAIN
        or next_turn.turn_type != Turn.TurnType.MAIN
    ):
        return None
    return Feedback.objects.create(
        turn=reply, author=user, kind=Feedback.Kind.IMPLICIT, next_turn=next_turn, comment=next_turn.content
    )


def _add_turn(conversation, parent, *, role, content, turn_type=Turn.TurnType.MAIN, **fields):
    return Turn.objects.create(
        conversation=conversation,
        parent=parent,
        index=parent.index + 1 if parent else 0,
        role=role,
        content=content,
        turn_type=turn_type,
        **fields,
    )


def post_user_message(conversation, content, *, user, parent=None, turn_type=Turn.TurnType.MAIN):
    """Save a user message (committed when this returns) under `parent` (default: the shown branch's end).

    If it follows an assistant reply, also store that reply's implicit next-state feedback.
    """
    _check_owner(conversation, user)
    validate_message(conversation.agent, content)
    if parent is not None and parent.conversation_id != conversation.pk:
        raise NotFound("No such message.")
    with transaction.atomic():
        # Serialize writers on one conversation so indexes and branches stay consistent.
        Conversation.objects.select_for_update().filter(pk=conversation.pk).first()
        if parent is None:
            branch = shown_branch(conversation)
            parent = branch[-1] if branch else None
        turn = _add_turn(conversation, parent, role=Turn.Role.USER, content=content, turn_type=turn_type)
        _record_next_state(parent, turn, user)
        update = ["updated_at"]
        if not conversation.title:
            conversation.title = _title_from(content)
            update.append("title")
        conversation.save(update_fields=update)
    return turn


def _title_from(content):
    words = " ".join(content.split())
    return words if len(words) <= 60 else words[:59].rstrip() + "…"


apost_user_message = database_sync_to_async(post_user_message)


# Replies
# ------------------------------------------------------------------------------


@dataclass
class ReplyEvent:
    """What `agenerate_reply` yields: "started" (turn), "delta" (text), then "done" (turn)."""

    kind: str
    turn: Turn | None = None
    text: str = ""


def _sampling_for(agent, overrides=None):
    params = {"temperature": agent.temperature, "top_p": agent.top_p, "max_tokens": agent.max_tokens, "seed": None, "stop": None}
    for key, value in (overrides or {}).items():
        if key in params and value is not None:
            params[key] = value
    return params


def _start_reply(parent, version, overrides, turn_type):
    conversation = Conversation.objects.select_related("agent").get(pk=parent.conversation_id)
    agent = conversation.agent
    chain = ancestors(parent)
    params = _sampling_for(agent, overrides)
    adapter = version.name if version is not None else None  # None: the client asks for the base model
    try:
        prompt = chat_context.build_prompt(agent, chain, max_tokens=params["max_tokens"])
        error = ""
    except chat_context.ContextTooLong as exc:
        prompt, error = None, str(exc)
    if prompt is not None:
        params["max_tokens"] = prompt.max_tokens
    with transaction.atomic():
        reply = _add_turn(
            conversation,
            parent,
            role=Turn.Role.ASSISTANT,
            content="",
            turn_type=turn_type or parent.turn_type,
            status=Turn.Status.FAILED if error else Turn.Status.STREAMING,
            error=error,
            adapter_version=version,
            adapter_name=version.name if version is not None else "",
            sampling_params={**params, "model": adapter or settings.SERVED_MODEL_NAME},
            context_start_index=prompt.context_start_index if prompt else None,
            finished_at=timezone.now() if error else None,
        )
        Conversation.objects.filter(pk=conversation.pk).update(updated_at=timezone.now())
    reply.conversation = conversation
    return reply, prompt, adapter


def _finish_reply(reply, **fields):
    fields.setdefault("finished_at", timezone.now())
    for key, value in fields.items():
        setattr(reply, key, value)
    # Only the generation writes a streaming turn, so a plain update by pk is safe.
    Turn.objects.filter(pk=reply.pk).update(**fields)
    return reply


_astart_reply = database_sync_to_async(_start_reply)
_afinish_reply = database_sync_to_async(_finish_reply)


def _logprob_value(item):
    if isinstance(item, dict):
        return item.get("logprob")
    if hasattr(item, "logprob"):
        return item.logprob
    return item


async def agenerate_reply(parent, *, regenerate=False, sampling=None, turn_type=None):
    """Generate the assistant reply to `parent` (a user or tool turn), streaming.

    With `regenerate`, earlier replies to `parent` stay as siblings; the new one becomes the shown one.
    Yields ReplyEvent("started", turn), ReplyEvent("delta", text=...)..., ReplyEvent("done", turn).
    On cancellation the partial text is kept with status "stopped"; an inference failure gives
    status "failed" with a visible error. The user's message is never touched.
    """
    from serving import services as serving_services
    from serving.client import InferenceError, InferenceUnavailable, SamplingParams, get_client

    if parent.role not in (Turn.Role.USER, Turn.Role.TOOL):
        raise InvalidInput("Replies answer a user or tool message.")
    conversation = await Conversation.objects.aget(pk=parent.conversation_id)
    version = await serving_services.aactive_version_for(conversation.user_id, conversation.agent_id)
    reply, prompt, adapter = await _astart_reply(parent, version, sampling, turn_type)
    yield ReplyEvent("started", reply)
    if prompt is None:  # the context check failed; the turn is already saved as failed
        reply.failure = "context"
        yield ReplyEvent("done", reply)
        return

    params = reply.sampling_params
    parts, token_ids, logprobs = [], [], []
    prompt_token_ids, finish_reason = None, None
    started = time.monotonic()
    ttft_ms = None
    finished = False
    try:
        stream = get_client().stream_chat(
            prompt.messages,
            adapter=adapter,
            params=SamplingParams(
                temperature=params["temperature"],
                top_p=params["top_p"],
                max_tokens=params["max_tokens"],
                seed=params["seed"],
                stop=params["stop"],
            ),
            affinity_key=f"u{conversation.user_id}",
        )
        async for event in stream:
            if event.prompt_token_ids and prompt_token_ids is None:
                prompt_token_ids = list(event.prompt_token_ids)
            if event.token_ids:
                token_ids.extend(event.token_ids)
            if event.logprobs:
                logprobs.extend(_logprob_value(x) for x in event.logprobs)
            if event.finish_reason:
                finish_reason = event.finish_reason
            if event.text:
                if ttft_ms is None:
                    ttft_ms = int((time.monotonic() - started) * 1000)
                parts.append(event.text)
                yield ReplyEvent("delta", reply, event.text)
        finished = True
        await _afinish_reply(
            reply,
            content="".join(parts),
            status=Turn.Status.COMPLETE,
            prompt_token_ids=prompt_token_ids,
            token_ids=token_ids,
            logprobs=logprobs,
            sampling_params={**params, "finish_reason": finish_reason},
            latency_ms=int((time.monotonic() - started) * 1000),
            ttft_ms=ttft_ms,
        )
    except (InferenceUnavailable, InferenceError) as exc:
        finished = True
        reply.failure = "unavailable" if isinstance(exc, InferenceUnavailable) else "error"
        logger.warning("reply %s failed: %s", reply.pk, exc)
        await _afinish_reply(
            reply,
            content="".join(parts),
            status=Turn.Status.FAILED,
            error=_inference_error_text(exc, InferenceUnavailable),
            latency_ms=int((time.monotonic() - started) * 1000),
        )
    except (asyncio.CancelledError, GeneratorExit):
        if not finished:
            await asyncio.shield(
                _afinish_reply(
                    reply,
                    content="".join(parts),
                    status=Turn.Status.STOPPED,
                    prompt_token_ids=prompt_token_ids,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    latency_ms=int((time.monotonic() - started) * 1000),
                    ttft_ms=ttft_ms,
                )
            )
        raise
    except Exception:
        finished = True
        reply.failure = "error"
        logger.exception("reply %s failed unexpectedly", reply.pk)
        await _afinish_reply(reply, content="".join(parts), status=Turn.Status.FAILED, error="Generation failed unexpectedly.")
    yield ReplyEvent("done", reply)


def _inference_error_text(exc, unavailable_cls):
    if isinstance(exc, unavailable_cls):
        return "The model server is unavailable right now. Your message is saved; retry in a moment."
    return f"The model server returned an error: {exc}"


async def acollect_reply(parent, **kwargs):
    """Run agenerate_reply to the end and return the finished assistant turn."""
    reply = None
    async for event in agenerate_reply(parent, **kwargs):
        reply = event.turn or reply
    return reply


def regenerate_target(user, turn_id):
    """The parent to regenerate under, given the assistant turn to replace (or a user turn to retry)."""
    turn = get_turn(user, turn_id)
    if turn.role == Turn.Role.ASSISTANT:
        if turn.status == Turn.Status.STREAMING:
            raise InvalidInput("That reply is still being generated.")
        if turn.parent_id is None:
            raise InvalidInput("That reply has no message to answer.")
        return Turn.objects.select_related("conversation").get(pk=turn.parent_id)
    if turn.role in (Turn.Role.USER, Turn.Role.TOOL):
        return turn
    raise InvalidInput("Only replies can be regenerated.")


aregenerate_target = database_sync_to_async(regenerate_target)


# Feedback
# ------------------------------------------------------------------------------

EXPLICIT_KINDS = {Feedback.Kind.THUMB_UP, Feedback.Kind.THUMB_DOWN, Feedback.Kind.CORRECTION, Feedback.Kind.COMMENT}


def record_feedback(turn, *, user, kind, reason="", comment="", corrected_text=""):
    """Store explicit feedback on an assistant reply (committed when this returns).

    Thumbs are one live per (turn, author): giving the other thumb flips it; the same one again
    updates its reason and comment.
    """
    _check_owner(turn.conversation, user)
    if kind not in EXPLICIT_KINDS:
        raise InvalidInput("kind must be one of thumb_up, thumb_down, correction, comment.", param="kind")
    for name, value in (("reason", reason), ("comment", comment), ("corrected_text", corrected_text)):
        if not isinstance(value, str):
            raise InvalidInput(f"{name} must be a string.", param=name)
    if turn.role != Turn.Role.ASSISTANT:
        raise InvalidInput("Feedback goes on the agent's replies only.")
    if turn.status not in (Turn.Status.COMPLETE, Turn.Status.STOPPED):
        raise InvalidInput("Feedback goes on finished replies only.")
    if len(reason) > 100:
        raise InvalidInput("The reason is longer than 100 characters.", param="reason")
    limit = settings.MAX_CORRECTION_CHARS
    if kind == Feedback.Kind.CORRECTION:
        if not corrected_text.strip():
            raise InvalidInput("A correction needs the corrected text.", param="corrected_text")
        if len(corrected_text) > limit:
            raise TooLarge(f"The correction is {len(corrected_text)} characters; the limit is {limit}.", param="corrected_text")
    if kind == Feedback.Kind.COMMENT and not comment.strip():
        raise InvalidInput("A comment needs some text.", param="comment")
    if len(comment) > limit:
        raise TooLarge(f"The comment is {len(comment)} characters; the limit is {limit}.", param="comment")

    fields = {"reason": reason, "comment": comment, "corrected_text": corrected_text}
    if kind not in Feedback.THUMBS:
        return Feedback.objects.create(turn=turn, author=user, kind=kind, **fields)
    for _attempt in range(2):
        try:
            with transaction.atomic():
                live = (
                    Feedback.objects.select_for_update()
                    .filter(turn=turn, author=user, kind__in=Feedback.THUMBS, withdrawn=False)
                    .first()
                )
                if live is not None and live.kind == kind:
                    # The same thumb again restates its reason and comment (the reward is unchanged).
                    changed = [name for name, value in fields.items() if getattr(live, name) != value]
                    for name in changed:
                        setattr(live, name, fields[name])
                    if changed:
                        live.save(update_fields=[*changed, "updated_at"])
                    return live
                if live is not None:
                    live.withdrawn = True
                    live.save(update_fields=["withdrawn", "updated_at"])
                return Feedback.objects.create(turn=turn, author=user, kind=kind, **fields)
        except IntegrityError:  # a concurrent click won the unique constraint; read it again
            continue
    raise InvalidInput("The thumb changed concurrently; try again.")


def withdraw_thumb(turn, user):
    """Withdraw the user's live thumb on `turn`; returns it, or None if there was none."""
    _check_owner(turn.conversation, user)
    with transaction.atomic():
        live = (
            Feedback.objects.select_for_update()
            .filter(turn=turn, author=user, kind__in=Feedback.THUMBS, withdrawn=False)
            .first()
        )
        if live is not None:
            live.withdrawn = True
            live.save(update_fields=["withdrawn", "updated_at"])
    return live


arecord_feedback = database_sync_to_async(record_feedback)
awithdraw_thumb = database_sync_to_async(withdraw_thumb)


# The /v1 API: clients resend the whole history
# ------------------------------------------------------------------------------


def derived_session_key(messages):
    """A stable session key for clients without X-Session-Id: a hash of the history's opening."""
    opening = []
    for message in messages:
        opening.append([message["role"], message["content"]])
        if message["role"] == Turn.Role.USER:
            break
    return "auto-" + hashlib.sha256(json.dumps(opening, ensure_ascii=False).encode()).hexdigest()[:40]


def _same(turn, message):
    return turn.role == message["role"] and turn.content.strip() == message["content"].strip()


def ingest_history(user, agent, messages, *, session_key=None, turn_type=Turn.TurnType.MAIN, done=False):
    """Match a resent history against the stored turns; store only the new messages.

    Args:
        messages: [{"role", "content"}...], validated; the last one is a user or tool message.
        session_key: X-Session-Id, or None to derive one from the opening messages.

    Returns:
        (conversation, parent): the turn to answer (the last message, stored or matched).
    """
    key = session_key or derived_session_key(messages)
    for message in messages:
        if message["role"] in (Turn.Role.USER, Turn.Role.TOOL) and len(message["content"]) > settings.MAX_MESSAGE_CHARS:
            raise TooLarge(
                f"A message is {len(message['content'])} characters; the limit is {settings.MAX_MESSAGE_CHARS}.",
                param="messages",
            )
    with transaction.atomic():
        conversation, _ = Conversation.objects.get_or_create(
            user=user,
            agent=agent,
            session_key=key,
            defaults={"source": Conversation.Source.API, "title": _title_from(_first_user_text(messages))},
        )
        conversation = Conversation.objects.select_for_update().select_related("agent").get(pk=conversation.pk)
        children = _children_map(list(conversation.turns.all()))
        parent, matched = None, 0
        for message in messages:
            candidates = [t for t in children.get(parent.pk if parent else None, []) if _same(t, message)]
            if not candidates:
                break
            # Prefer the newest complete match (a retried request may have left failed siblings).
            good = [t for t in candidates if t.status != Turn.Status.FAILED] or candidates
            parent = good[-1]
            matched += 1
        new = messages[matched:]
        if new:
            last = new[-1]
            validate_message(agent, last["content"], role=last["role"])
        for message in new:
            turn = _add_turn(conversation, parent, role=message["role"], content=message["content"], turn_type=turn_type)
            if message["role"] in (Turn.Role.USER, Turn.Role.TOOL):
                _record_next_state(parent, turn, user)
            parent = turn
        if done and not conversation.done:
            conversation.done = True
        conversation.save(update_fields=["done", "updated_at"])
    return conversation, parent


def _first_user_text(messages):
    return next((m["content"] for m in messages if m["role"] == Turn.Role.USER), "")


aingest_history = database_sync_to_async(ingest_history)


# Payloads (what the WebSocket frames and the JSON API carry)
# ------------------------------------------------------------------------------


def _iso(value):
    return value.isoformat() if value else None


def agent_payload(agent):
    return {"id": agent.pk, "name": agent.name, "slug": agent.slug, "description": agent.description, "global": agent.is_global}


def conversation_payload(conversation, *, turns=None):
    data = {
        "id": conversation.pk,
        "agent_id": conversation.agent_id,
        "title": conversation.title,
        "source": conversation.source,
        "done": conversation.done,
        "created_at": _iso(conversation.created_at),
        "updated_at": _iso(conversation.updated_at),
    }
    if turns is not None:
        data["turns"] = [turn_payload(t) for t in turns]
    return data


def turn_payload(turn):
    data = {
        "id": turn.pk,
        "conversation_id": turn.conversation_id,
        "parent_id": turn.parent_id,
        "index": turn.index,
        "role": turn.role,
        "content": turn.content,
        "status": turn.status,
        "turn_type": turn.turn_type,
        "error": turn.error,
        "adapter": turn.adapter_name or None,
        "version": f"v{turn.adapter_name.rsplit('-v', 1)[-1]}" if turn.adapter_name else "base",
        "context_start_index": turn.context_start_index,
        "latency_ms": turn.latency_ms,
        "ttft_ms": turn.ttft_ms,
        "created_at": _iso(turn.created_at),
        "finished_at": _iso(turn.finished_at),
    }
    if hasattr(turn, "sibling_ids"):
        data["siblings"] = {"ids": turn.sibling_ids, "count": len(turn.sibling_ids), "position": turn.sibling_position}
    return data


def feedback_payload(feedback):
    return {
        "id": feedback.pk,
        "turn_id": feedback.turn_id,
        "kind": feedback.kind,
        "reason": feedback.reason,
        "comment": feedback.comment,
        "corrected_text": feedback.corrected_text,
        "status": feedback.status,
        "withdrawn": feedback.withdrawn,
        "created_at": _iso(feedback.created_at),
    }
