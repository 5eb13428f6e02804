from django.urls import path

from . import metrics, views

app_name = "training"
urlpatterns = [
    # Users: their own personalization of one agent
    path("training/agents/<int:agent_id>/panel/", views.panel, name="panel"),
    path("training/agents/<int:agent_id>/train/", views.train_now, name="train-now"),
    path("training/agents/<int:agent_id>/jobs/<int:job_id>/cancel/", views.cancel_job, name="cancel-job"),
    path("training/agents/<int:agent_id>/versions/", views.history, name="history"),
    path("training/agents/<int:agent_id>/versions/<int:version_id>/diff/", views.diff, name="diff"),
    path("training/agents/<int:agent_id>/activate/", views.activate, name="activate"),
    path("training/agents/<int:agent_id>/delete/", views.delete_data, name="delete-data"),
    # Staff
    path("staff/", views.staff_home, name="staff-home"),
    path("staff/review/", views.review_queue, name="review-queue"),
    path("staff/review/bulk/", views.review_bulk, name="review-bulk"),
    path("staff/review/<int:feedback_id>/", views.review_item, name="review-item"),
    path("staff/review/<int:feedback_id>/reserve/", views.review_reserve, name="review-reserve"),
    path("staff/review/<int:feedback_id>/release/", views.review_release, name="review-release"),
    path("staff/review/<int:feedback_id>/approve/", views.review_approve, name="review-approve"),
    path("staff/review/<int:feedback_id>/fix/", views.review_fix, name="review-fix"),
    path("staff/review/<int:feedback_id>/reject/", views.review_reject, name="review-reject"),
    path("staff/agents/<int:agent_id>/", views.staff_agent, name="staff-agent"),
    path("staff/agents/<int:agent_id>/policy/", views.staff_agent_policy, name="staff-agent-policy"),
    path("staff/users/<int:user_id>/", views.staff_user, name="staff-user"),
    path("staff/users/<int:user_id>/agents/<int:agent_id>/versions/", views.staff_history, name="staff-history"),
    path("staff/users/<int:user_id>/agents/<int:agent_id>/activate/", views.staff_activate, name="staff-activate"),
    path("staff/versions/<int:version_id>/diff/", views.staff_diff, name="staff-diff"),
    path("staff/training/pause/", views.staff_pause, name="staff-pause"),
    path("staff/training/resume/", views.staff_resume, name="staff-resume"),
    path("staff/audit/", views.audit_log, name="audit"),
    path("staff/plots/<str:kind>.<str:fmt>", views.plot, name="plot"),
    path("staff/export.jsonl", views.export_jsonl, name="export"),
    path("metrics", metrics.metrics_view, name="metrics"),
]
