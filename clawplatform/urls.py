from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("serving.urls")),
    path("", include("training.urls")),
    path("", include("chat.urls")),
]
