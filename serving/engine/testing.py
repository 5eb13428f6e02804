"""Helpers for tests and benchmarks: a real engine server in a subprocess, and real PEFT adapters."""
import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process, grace=15):
    """Terminate a subprocess, killing it if it hasn't exited after `grace` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class EngineServer:
    url: str  # e.g. "http://127.0.0.1:8123", without /v1
    process: subprocess.Popen
    port: int
    log_path: Path

    def __str__(self):
        return self.url

    def log(self):
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextlib.contextmanager
def run_engine_server(model_dir, *, port=0, env=None, extra_args=(), startup_timeout=120):
    """Run `manage.py serve_model` in a real subprocess until the block exits.

    Args:
        model_dir: the model directory to serve.
        port: 0 picks a free port.
        env: extra environment variables for the server process.
        extra_args: more command-line arguments (e.g. ["--max-loras", "2"]).
    Yields: EngineServer with `.url` and `.process` (kill it to test faults).
    """
    port = port or free_port()
    child_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "clawplatform.settings.test", "PYTHONUNBUFFERED": "1",
                 **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    log_dir = REPO / "var" / "test-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"engine-{port}.log"
    command = [sys.executable, str(REPO / "manage.py"), "serve_model", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *map(str, extra_args)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=child_env, stdout=log, stderr=subprocess.STDOUT)
    server = EngineServer(url=f"http://127.0.0.1:{port}", process=process, port=port, log_path=log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"serve_model exited with {process.returncode}:\n{server.log()[-4000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve_model did not become healthy in {startup_timeout}s:\n{server.log()[-4000:]}")
            time.sleep(0.2)
        yield server
    finally:
        stop_process(process)


def make_peft_adapter(model_dir, out_dir, *, rank=4, alpha=8, seed=0, target_modules=ALL_TARGETS, std=0.05,
                      base_model_name="base"):
    """Save a real PEFT LoRA adapter with non-zero B (peft inits B to zero) as safetensors.

    Returns: the adapter directory (a Path).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.peft_config["default"].base_model_name_or_path = base_model_name
    peft_model.save_pretrained(str(out_dir), safe_serialization=True, save_embedding_layers=False)
    return Path(out_dir)
