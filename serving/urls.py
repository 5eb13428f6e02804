from django.urls import path

from serving import views

app_name = "serving"
urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
]
