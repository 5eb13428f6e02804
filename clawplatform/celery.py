"""The Celery app. Workers: `celery -A clawplatform worker -Q default,training`."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "clawplatform.settings.local")

app = Celery("clawplatform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
