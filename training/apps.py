from django.apps import AppConfig
from django.db.models.signals import post_save


class TrainingConfig(AppConfig):
    name = "training"
    verbose_name = "Training"

    def ready(self):
        from chat.account import account_deleting
        from chat.models import Feedback

        from .accounts import forget_user
        from .signals import feedback_saved

        post_save.connect(feedback_saved, sender=Feedback, dispatch_uid="training.feedback_saved")
        account_deleting.connect(forget_user, dispatch_uid="training.forget_user")
