from django.urls import path

app_name = "serving"
urlpatterns: list = []
