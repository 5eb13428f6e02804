"""The chat socket: one per browser tab, at /ws/chat/. Frames are documented in docs/websocket.md.

A bad frame gets an `error` frame back and never closes the socket or raises. Each generation
runs as its own task so `generation.stop` can cancel it; stopping reaches the task through the
user's group, so any tab of that user can stop a reply another tab started.
"""
import asyncio
import json
import logging
from contextlib import aclosing

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from . import presence, ratelimit, services
from .models import Turn

logger = logging.getLogger(__name__)

_NO_ID = object()


class FrameError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def _int_field(content, name, *, required=True, nullable=False):
    value = content.get(name, _NO_ID)
    if value is _NO_ID or (value is None and not nullable):
        if value is None or required:
            raise FrameError("invalid", f"'{name}' is required and must be an integer id.")
        return None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FrameError("invalid", f"'{name}' must be a positive integer id.")
    return value


class ChatConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.user = user
        self.group = services.user_group(user.pk)
        self.generations = {}  # assistant turn id -> asyncio.Task
        await self.channel_layer.group_add(self.group, self.channel_name)
        # Counted before the accept: a client that reads the gauge once connected must see itself.
        self.counted = True
        await presence.asocket_opened()
        await self.accept()

    async def disconnect(self, code):
        if not hasattr(self, "user"):
            return
        if getattr(self, "counted", False):
            self.counted = False
            await presence.asocket_closed()
        await self.channel_layer.group_discard(self.group, self.channel_name)
        # Nobody is listening any more: stop our replies (each keeps its partial text, "stopped").
        tasks = list(self.generations.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    # Frames in
    # --------------------------------------------------------------------------

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        if bytes_data is not None:
            await self.send_error("invalid", "Binary frames are not supported; send JSON text.")
            return
        try:
            content = json.loads(text_data)
        except (TypeError, ValueError, RecursionError):  # RecursionError: nested too deeply
            await self.send_error("bad_json", "The frame is not valid JSON.")
            return
        await self.receive_json(content)

    async def receive_json(self, content, **kwargs):
        request_id = content.get("request_id") if isinstance(content, dict) else None
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            request_id = None
        if not isinstance(content, dict):
            await self.send_error("invalid", "A frame must be a JSON object with a 'type'.")
            return
        frame_type = content.get("type")
        handler = self.FRAME_HANDLERS.get(frame_type) if isinstance(frame_type, str) else None  # a dict isn't hashable
        if handler is None:
            await self.send_error("unknown_type", f"Unknown frame type: {str(content.get('type'))[:50]!r}.", request_id)
            return
        try:
            await handler(self, content, request_id)
        except FrameError as exc:
            await self.send_error(exc.code, exc.message, request_id)
        except services.RateLimited as exc:
            await self.send_error(exc.code, exc.message, request_id, retry_after=exc.retry_after)
        except services.ChatError as exc:
            await self.send_error(exc.code, exc.message, request_id)
        except Exception:
            logger.exception("frame %s failed", content.get("type"))
            await self.send_error("server_error", "Something went wrong on our side.", request_id)

    async def frame_ping(self, content, request_id):
        await self.reply("pong", request_id)

    async def frame_message_send(self, content, request_id):
        conversation_id = _int_field(content, "conversation_id", required=False, nullable=True)
        text = content.get("content")
        if not isinstance(text, str):
            raise FrameError("invalid", "'content' must be a string.")
        if conversation_id is None:
            agent = await services.aget_agent(self.user, _int_field(content, "agent_id"))
            conversation = None
        else:
            conversation = await services.aget_conversation(self.user, conversation_id)
            agent = conversation.agent
            if content.get("agent_id") not in (None, agent.pk):
                raise FrameError("invalid", "'agent_id' does not match the conversation's agent.")
        if len(text) > settings.MAX_MESSAGE_CHARS:  # cheap check first; the full one runs on save
            raise services.TooLarge(f"The message is {len(text)} characters; the limit is {settings.MAX_MESSAGE_CHARS}.")
        await self.check_rate()
        if conversation is None:
            # Validate before creating, so a refused first message leaves no empty conversation.
            await services.avalidate_message(agent, text)
            conversation = await services.acreate_conversation(self.user, agent)
            await self.reply("conversation.created", request_id, conversation=services.conversation_payload(conversation))
        turn = await services.apost_user_message(conversation, text, user=self.user)
        # post_user_message returns after its transaction committed: the ack can't outrun the row.
        await self.reply("message.saved", request_id, turn=services.turn_payload(turn))
        self.start_generation(turn, request_id)

    async def frame_generation_stop(self, content, request_id):
        turn = await services.aget_turn(self.user, _int_field(content, "turn_id"))
        if turn.role != Turn.Role.ASSISTANT:
            raise FrameError("invalid", "Only a reply can be stopped.")
        if turn.status == Turn.Status.STREAMING:
            await self.channel_layer.group_send(self.group, {"type": "generation.cancel", "turn_id": turn.pk})
        else:  # already over: say how it ended
            await self.reply("reply.done", request_id, turn=services.turn_payload(turn))

    async def frame_message_regenerate(self, content, request_id):
        turn = await services.aget_turn(self.user, _int_field(content, "turn_id"))
        if turn.role != Turn.Role.ASSISTANT:
            raise FrameError("invalid", "Only a reply can be regenerated.")
        await self._generate_again(turn, request_id)

    async def frame_message_retry(self, content, request_id):
        turn = await services.aget_turn(self.user, _int_field(content, "turn_id"))
        await self._generate_again(turn, request_id)

    async def _generate_again(self, turn, request_id):
        parent = await services.aregenerate_target(self.user, turn.pk)
        await self.check_rate()
        self.start_generation(parent, request_id, regenerate=True)

    FRAME_HANDLERS = {
        "ping": frame_ping,
        "message.send": frame_message_send,
        "generation.stop": frame_generation_stop,
        "message.regenerate": frame_message_regenerate,
        "message.retry": frame_message_retry,
    }

    # Generation
    # --------------------------------------------------------------------------

    async def check_rate(self):
        retry = await ratelimit.ahit("messages", self.user.pk, ratelimit.message_limit())
        if retry is not None:
            raise services.RateLimited(retry, f"You are sending messages too fast; try again in {retry} s.")

    def start_generation(self, parent, request_id, *, regenerate=False):
        task = asyncio.ensure_future(self._run_generation(parent, request_id, regenerate))
        task.add_done_callback(self._generation_finished)

    def _generation_finished(self, task):
        for turn_id, running in list(self.generations.items()):
            if running is task:
                del self.generations[turn_id]
        if not task.cancelled() and task.exception() is not None:
            logger.error("generation task failed", exc_info=task.exception())

    async def _run_generation(self, parent, request_id, regenerate):
        try:
            # aclosing: a cancel that lands while we send a frame still closes the generator,
            # which then saves the partial reply as "stopped".
            async with aclosing(services.agenerate_reply(parent, regenerate=regenerate)) as events:
                async for event in events:
                    if event.kind == "started":
                        self.generations[event.turn.pk] = asyncio.current_task()
                        await self.reply("reply.started", request_id, turn=services.turn_payload(event.turn))
                    elif event.kind == "delta":
                        await self.reply("reply.delta", request_id, turn_id=event.turn.pk, text=event.text)
                    else:
                        await self.reply("reply.done", request_id, turn=services.turn_payload(event.turn))
        except asyncio.CancelledError:
            turn = await self._stopped_turn(parent)
            if turn is not None:
                try:
                    await self.reply("reply.done", request_id, turn=services.turn_payload(turn))
                except Exception:  # the socket is gone
                    pass
            raise

    async def _stopped_turn(self, parent):
        for turn_id, task in self.generations.items():
            if task is asyncio.current_task():
                try:
                    return await asyncio.shield(Turn.objects.aget(pk=turn_id))
                except Exception:
                    return None
        return None

    # Group events
    # --------------------------------------------------------------------------

    async def generation_cancel(self, event):
        task = self.generations.get(event["turn_id"])
        if task is not None:
            task.cancel()

    async def job_progress(self, event):
        await self.send_json({k: event.get(k) for k in ("type", "job_id", "agent_id", "state", "progress")})

    async def version_activated(self, event):
        await self.send_json({"type": "version.activated", "agent_id": event.get("agent_id"), "version": event.get("version")})

    # Frames out
    # --------------------------------------------------------------------------

    async def reply(self, frame_type, request_id=None, **payload):
        frame = {"type": frame_type, **payload}
        if request_id is not None:
            frame["request_id"] = request_id
        await self.send_json(frame)

    async def send_error(self, code, message, request_id=None, **extra):
        await self.send_json({"type": "error", "code": code, "message": message, "request_id": request_id, **extra})
