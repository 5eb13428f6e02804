"""Load every active adapter onto the inference replicas that lack it.

Run once the engine (or vLLM) answers /health, e.g. by ./run after starting `serve_model`, or by
hand after a replica restarts. Workers do the same on start (training.tasks, `worker_ready`).
"""
from django.core.management.base import BaseCommand

from serving.services import ensure_replica_adapters


class Command(BaseCommand):
    help = "Load every active adapter onto the inference replicas that lack it."

    def handle(self, *args, **options):
        loaded = ensure_replica_adapters()
        for url, names in loaded.items():
            self.stdout.write(f"{url}: loaded {len(names)} adapter(s){': ' + ', '.join(names) if names else ''}")
