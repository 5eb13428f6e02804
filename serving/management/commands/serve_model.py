"""`python manage.py serve_model`: the built-in engine behind vLLM's OpenAI-compatible API."""
import argparse
import logging
import math

from django.conf import settings
from django.core.management.base import BaseCommand


def non_negative_seconds(value):
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return seconds


class Command(BaseCommand):
    help = "Serve the base model and hot-loaded LoRA adapters over vLLM's OpenAI-compatible HTTP API."

    def add_arguments(self, parser):
        parser.add_argument("--model", default=None, help="Model directory (default: settings.MODEL).")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8001)
        parser.add_argument("--served-model-name", default=None,
                            help="Name of the base model in requests (default: settings.SERVED_MODEL_NAME).")
        parser.add_argument("--max-loras", type=int, default=settings.ENGINE_MAX_LOADED_ADAPTERS,
                            help="Adapters held in memory at once; the least recently used idle one is evicted.")
        parser.add_argument("--max-lora-rank", type=int, default=64)
        parser.add_argument("--max-batch", type=int, default=settings.ENGINE_MAX_BATCH,
                            help="Requests in one forward pass.")
        parser.add_argument("--max-model-len", type=int, default=settings.MODEL_MAX_CONTEXT,
                            help="Context length; 0 means the model's max_position_embeddings.")
        parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default).")
        parser.add_argument("--step-delay", type=non_negative_seconds, default=0.0, metavar="SECONDS",
                            help="Pause between decode steps, to slow streaming down for demos and UI tests "
                                 "(default 0: as fast as the model goes).")

    def handle(self, *args, **options):
        import torch
        import uvicorn

        from serving.engine.engine import Engine
        from serving.engine.server import build_app

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if options["threads"]:
            torch.set_num_threads(options["threads"])
        model_dir = options["model"] or settings.MODEL
        served_name = options["served_model_name"] or settings.SERVED_MODEL_NAME
        engine = Engine(model_dir, device=options["device"], max_loras=options["max_loras"],
                        max_batch=options["max_batch"], max_lora_rank=options["max_lora_rank"],
                        max_model_len=options["max_model_len"] or None, step_delay=options["step_delay"])
        self.stdout.write(f"Serving {model_dir} as '{served_name}' on {engine.device} at "
                          f"http://{options['host']}:{options['port']}"
                          + (f", pausing {engine.step_delay} s between steps" if engine.step_delay else ""))
        uvicorn.run(build_app(engine, served_name), host=options["host"], port=options["port"],
                    log_level="warning", access_log=False)
