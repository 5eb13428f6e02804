"""`python manage.py bench_personalization`: the personalization benchmark (bench/personalization.py)."""
from django.core.management.base import BaseCommand

from bench import personalization


class Command(BaseCommand):
    help = "Simulated users personalize agents through the platform; compares no training, Binary RL, OPD, combined, offline."

    def add_arguments(self, parser):
        personalization.add_arguments(parser)

    def handle(self, *args, **options):
        personalization.execute(options)
