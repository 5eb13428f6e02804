"""`python manage.py build_demo_model`: build the offline demo chat model (cached)."""
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from serving.demo_model import DemoModelConfig, build_demo_model, is_built


class Command(BaseCommand):
    help = "Build the offline demo chat model (Hugging Face format) unless it is already built."

    def add_arguments(self, parser):
        parser.add_argument("--output", type=Path, default=None, help="Directory to build into (default: settings.DEMO_MODEL_DIR).")
        parser.add_argument("--tiny", action="store_true", help="Build the tiny test config (seconds, not smart).")
        parser.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")

    def handle(self, *args, output=None, tiny=False, no_progress=False, **options):
        output = Path(output or settings.DEMO_MODEL_DIR)
        config = DemoModelConfig.tiny() if tiny else DemoModelConfig()
        if is_built(output, config):
            self.stdout.write(f"Demo model already built at {output}")
            return
        started = time.monotonic()
        build_demo_model(output, config, progress=not no_progress and options.get("verbosity", 1) > 0)
        self.stdout.write(self.style.SUCCESS(f"Built demo model at {output} in {time.monotonic() - started:.0f}s"))
