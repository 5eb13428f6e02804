"""Create the demo accounts and global demo agents that `./run` prints. Safe to run again.

Passwords come from DEMO_ADMIN_PASSWORD / DEMO_USER_PASSWORD, else are generated on creation and
kept in DATA_DIR/demo-credentials.txt (mode 600) so every later run can print them again. An
existing account's password is never changed, except with --reset-passwords.
"""
import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from chat.models import Agent

ACCOUNTS = [
    # (username, env var for the password, staff and superuser)
    ("admin", "DEMO_ADMIN_PASSWORD", True),
    ("demo", "DEMO_USER_PASSWORD", False),
]

AGENTS = [
    {
        "slug": "assistant",
        "name": "Assistant",
        "description": "A general helper. Tell it what you like and it adapts to you.",
        "system_prompt": "You are a helpful, concise assistant.",
        "probe_prompts": ["Say hello.", "Explain what a list is in one sentence.", "Give me a tip for today."],
    },
    {
        "slug": "tutor",
        "name": "Tutor",
        "description": "Explains things step by step; learns how much detail you want.",
        "system_prompt": "You are a patient tutor. Explain step by step.",
        "probe_prompts": ["What is 7 times 8?", "Why is the sky blue?", "How do I start learning to code?"],
    },
]


class Command(BaseCommand):
    help = "Create the demo admin, the demo user and global demo agents (idempotent); print the credentials."

    def add_arguments(self, parser):
        parser.add_argument("--reset-passwords", action="store_true", help="Give existing demo accounts new passwords.")

    def handle(self, *args, reset_passwords=False, **options):
        credentials_file = settings.DATA_DIR / "demo-credentials.txt"
        known = self._read_credentials(credentials_file)
        User = get_user_model()
        with transaction.atomic():
            for username, env_var, is_admin in ACCOUNTS:
                user = User.objects.filter(username=username).first()
                password = os.environ.get(env_var)
                if user is None:
                    password = password or secrets.token_urlsafe(9)
                    if is_admin:
                        user = User.objects.create_superuser(username=username, email="", password=password)
                    else:
                        user = User.objects.create_user(username=username, password=password)
                    known[username] = password
                elif reset_passwords or (password and not user.check_password(password)):
                    password = password or secrets.token_urlsafe(9)
                    user.set_password(password)
                    user.save(update_fields=["password"])
                    known[username] = password
            for spec in AGENTS:
                Agent.objects.get_or_create(
                    owner=None, slug=spec["slug"], defaults={k: v for k, v in spec.items() if k != "slug"}
                )
        self._write_credentials(credentials_file, known)
        self.stdout.write(self.style.SUCCESS("Demo accounts (also in %s):" % credentials_file))
        for username, _, is_admin in ACCOUNTS:
            role = "admin, /admin/" if is_admin else "user"
            password = known.get(username, "(unchanged; use --reset-passwords)")
            self.stdout.write(f"    {username:<6} / {password}    ({role})")

    @staticmethod
    def _read_credentials(path):
        known = {}
        if path.exists():
            for line in path.read_text().splitlines():
                parts = line.split()
                # Lines look like "    admin  / <password>    (role)".
                if len(parts) >= 3 and parts[1] == "/":
                    known[parts[0]] = parts[2]
        return known

    @staticmethod
    def _write_credentials(path, known):
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = ["Demo accounts (python manage.py seed_demo --reset-passwords makes new ones):"]
        for username, _, is_admin in ACCOUNTS:
            if username in known:
                lines.append(f"    {username:<6} / {known[username]}    ({'admin, /admin/' if is_admin else 'user'})")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
