"""Account deletion and data export across chat, training and serving.

Chat owns the user row and the views (`chat/account.py`); it sends `account_deleting` inside
the deleting transaction and `forget_user` below does what chat can't know about:

- the audit log keeps every event about or by the user, with the user's id and name replaced
  by `AuditEvent.TOMBSTONE` (the log stays append-only; only those fields may change);
- one `delete_account` event records what was removed (counts only, no content);
- open training jobs are asked to stop; samples, jobs and adapter versions go with the user's
  row (CASCADE);
- after the commit, the user's active adapters are unloaded from the inference replicas (best
  effort) and every adapter directory of theirs (`ADAPTER_ROOT/u<id>-a*-v*/`) and their jobs'
  staging directories are removed. A rolled-back deletion leaves every file in place.

`delete_account` and the exports are re-exported here for training's own callers (staff tools).
"""
import logging
import shutil

from django.db import transaction

from chat.account import account_deleting, delete_account, export_conversations, write_adapters_zip  # noqa: F401
from chat.models import Conversation, Feedback

from . import services
from .models import AuditEvent, TrainingJob, TrainingSample

logger = logging.getLogger(__name__)


def forget_user(sender, *, user, actor=None, **kwargs):
    """`account_deleting` receiver: tombstone the audit log, stop jobs, schedule file removal."""
    from serving.adapters import adapter_root
    from serving.models import AdapterVersion

    versions = AdapterVersion.objects.filter(user=user)
    active = list(versions.filter(is_active=True).values_list("name", flat=True))
    names = list(versions.values_list("name", flat=True))
    job_ids = list(TrainingJob.objects.filter(user=user).values_list("pk", flat=True))
    TrainingJob.objects.filter(user=user, state__in=TrainingJob.OPEN_STATES).update(cancel_requested=True)
    removed = {
        "conversations": Conversation.objects.filter(user=user).count(),
        "feedback": Feedback.objects.filter(author=user).count(),
        "samples": TrainingSample.objects.filter(user=user).count(),
        "jobs": len(job_ids),
        "adapter_versions": len(names),
    }
    actor = actor or user
    services.audit(actor=actor, action="delete_account", subject_user_id=user.pk,
                   reason="deleted by the account's owner" if actor.pk == user.pk else "deleted by staff",
                   before=removed)
    # Tombstone every event about or by the user, the one just written included.
    AuditEvent.objects.filter(subject_user_id=user.pk).update(subject_user_id=None, subject_label=AuditEvent.TOMBSTONE)
    AuditEvent.objects.filter(actor=user).update(actor=None, actor_label=AuditEvent.TOMBSTONE)

    user_id = user.pk

    def remove_files():
        from serving.adapters import delete_adapter
        from serving.client import get_client

        for name in active:
            try:
                get_client().unload_adapter_sync(name)
            except Exception:  # best effort: a replica that is down has nothing loaded to leak
                logger.warning("could not unload %s", name, exc_info=True)
        root = adapter_root()
        # Rows name most directories; the glob also finds one a crashed publisher left unregistered.
        on_disk = {p.name for p in root.glob(f"u{user_id}-a*-v*")} if root.is_dir() else set()
        for name in sorted(set(names) | on_disk):
            try:
                delete_adapter(name)
            except OSError:
                logger.exception("could not delete the adapter files of %s", name)
        from .tasks import staging_dir

        for job_id in job_ids:
            shutil.rmtree(staging_dir(job_id), ignore_errors=True)
        logger.info("deleted account %s: %s", user_id, removed)

    transaction.on_commit(remove_files)
    return removed
