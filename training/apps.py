from django.apps import AppConfig
from django.db.models.signals import post_save


class TrainingConfig(AppConfig):
    name = "training"
    verbose_name = "Training"

    def ready(self):
        from chat.models import Feedback

        from .signals import feedback_saved

        post_save.connect(feedback_saved, sender=Feedback, dispatch_uid="training.feedback_saved")
