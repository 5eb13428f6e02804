from django.urls import path

app_name = "chat"
urlpatterns: list = []
