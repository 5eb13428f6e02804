"""A small urlconf for chat's API tests, independent of the pages' chat/urls.py."""
from django.urls import include, path

urlpatterns = [path("", include("chat.api_urls"))]
