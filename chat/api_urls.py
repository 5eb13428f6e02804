"""URLs of the JSON API (/api/...) and the OpenAI-compatible API (/v1/...); chat/urls.py includes them."""
from django.urls import path

from . import api

urlpatterns = [
    path("api/agents", api.agents, name="api-agents"),
    path("api/conversations", api.conversations, name="api-conversations"),
    path("api/conversations/<int:conversation_id>", api.conversation_detail, name="api-conversation"),
    path("api/turns/<int:turn_id>/feedback", api.turn_feedback, name="api-turn-feedback"),
    path("api/turns/<int:turn_id>/feedback/thumb", api.turn_thumb, name="api-turn-thumb"),
    path("v1/models", api.v1_models, name="v1-models"),
    path("v1/chat/completions", api.v1_chat_completions, name="v1-chat-completions"),
]
