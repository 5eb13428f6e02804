"""The built-in inference engine: continuous batching over many LoRA adapters on one model.

An asyncio front (`Engine.generate`, `Engine.add_adapter`, ...) hands work to one model thread.
Between two decode steps the model thread installs adapters into free slots, admits waiting
requests (prefilled together, then merged into the running batch) and drops finished ones, so
a new request or a hot-loaded adapter never pauses the streams in flight.

Each row of the batch carries its own adapter slot (see `lora.py`); the KV cache is kept
left-padded, with an attention mask and per-row position ids, so a row's tokens do not depend
on what else is in the batch.
"""
import asyncio
import collections
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

from serving.protocol import SamplingParams

from .adapters import AdapterError, read_adapter
from .lora import LoRABatch, install_batched_lora

logger = logging.getLogger(__name__)

SLOT_GROWTH = 8  # slot buffers grow by this many slots at a time


class AdapterNotFound(KeyError):
    pass


@dataclass
class StepOutput:
    """What one request produced in one engine step (the stream's unit)."""

    token_ids: list
    logprobs: list
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list | None = None


@dataclass
class AdapterRecord:
    name: str
    path: str
    rank: int
    size_bytes: int
    loaded_at: float = field(default_factory=time.time)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    adapter: str | None
    adapter_path: str | None
    emit: object  # callable(StepOutput | Exception), thread-safe
    weights: object = None  # AdapterWeights read by the front when the adapter was not resident
    generator: torch.Generator | None = None
    slot: int = 0
    slot_key: str | None = None  # the key of its slot in Engine._resident (the name, or its tombstone)
    output_ids: list = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    length: int = 0  # tokens in the sequence so far (prompt + generated)
    done: bool = False


class Engine:
    """One model, many adapters, one forward pass per step for every running request.

    Args:
        model_dir: a Hugging Face causal LM directory (config, weights, tokenizer).
        device: "auto" (CUDA when present), "cpu" or "cuda".
        max_loras: adapters held in slots at once; the least recently used idle one is evicted.
        max_batch: requests in one forward pass.
        max_lora_rank: the largest LoRA rank accepted.
        max_model_len: context length; 0/None means the model's max_position_embeddings.
        step_delay: seconds the model thread waits after each step, to pace streaming for demos
            and UI tests (a tiny model on a CPU otherwise streams faster than anyone can press
            Stop); 0 runs flat out.
    """

    def __init__(self, model_dir, *, device="auto", max_loras=64, max_batch=32, max_lora_rank=64,
                 max_model_len=None, dtype=None, step_delay=0.0):
        if not step_delay >= 0:  # refuses nan too
            raise ValueError(f"step_delay must be >= 0, got {step_delay}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model_dir = str(model_dir)
        self.max_loras = int(max_loras)
        self.max_batch = int(max_batch)
        self.max_lora_rank = int(max_lora_rank)
        self.step_delay = float(step_delay)
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        config = self.model.config
        self.max_model_len = int(max_model_len or getattr(config, "max_position_embeddings", 2048))
        self.eos_token_ids = self._eos_ids()
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = min(self.eos_token_ids) if self.eos_token_ids else 0

        self._lora_batch = LoRABatch()
        self._lora_layers = install_batched_lora(self.model, self._lora_batch)
        self.module_shapes = {name: (m.in_features, m.out_features) for name, m in self._lora_layers.items()}

        # Front-side registry (asyncio thread): every adapter a request may name.
        self._registry: dict[str, AdapterRecord] = {}
        self._name_locks = collections.defaultdict(asyncio.Lock)

        # Slot state, shared with the model thread; the lock covers slot assignment only.
        self._slot_lock = threading.Lock()
        self._resident: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU order
        self._refcount: collections.Counter = collections.Counter()
        self._released: set = set()  # tombstones of unloaded adapters still used by running requests
        self._tombstones = itertools.count()
        self._free_slots = list(range(self.max_loras, 0, -1))
        self._slot_capacity = 1
        self._slot_rank = 1

        # Work handed to the model thread.
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._commands: collections.deque = collections.deque()
        self._aborted: set = set()
        self._running: list[_Request] = []
        self._admitting: list[_Request] = []
        self._cache = None
        self._mask = None  # [b, T] long
        self._stop = False
        self._thread = None
        self._seed_source = itertools.count(int(time.time() * 1e6) % (2**31))
        self.steps = 0
        self.generated_tokens = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-model", daemon=True)
            self._thread.start()
        return self

    def shutdown(self):
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    def _eos_ids(self):
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        try:
            gen = GenerationConfig.from_pretrained(self.model_dir)
            eos = gen.eos_token_id
        except (OSError, ValueError):
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        return ids

    # ------------------------------------------------------------------ front: prompts and adapters

    def render_chat(self, messages, *, add_generation_prompt=True, chat_template_kwargs=None):
        """Token ids of a chat, rendered with the tokenizer's template (like vLLM: text, then ids)."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def has_adapter(self, name):
        return name in self._registry

    def adapters(self):
        return list(self._registry.values())

    def resident_adapters(self):
        """Names of the adapters in slots, least recently used first (unloaded ones still in use excluded)."""
        with self._slot_lock:
            return [name for name in self._resident if name not in self._released]

    def stats(self):
        with self._slot_lock:
            resident = len(self._resident)
        return {
            "registered_adapters": len(self._registry),
            "loaded_adapters": resident,
            "running_requests": len(self._running),
            "waiting_requests": len(self._waiting),
            "engine_steps": self.steps,
            "generated_tokens": self.generated_tokens,
        }

    def _read(self, path):
        return read_adapter(path, max_rank=self.max_lora_rank, module_shapes=self.module_shapes)

    async def add_adapter(self, name, path):
        """Register `name` and load its weights into a slot. Raises AdapterError (400 if already loaded)."""
        async with self._name_locks[name]:
            if name in self._registry:
                raise AdapterError(
                    f"The lora adapter '{name}' has already been loaded. Unload it first; the built-in "
                    "engine never reloads a name in place.", err_type="InvalidUserInput")
            weights = await asyncio.to_thread(self._read, path)
            done = asyncio.get_running_loop().create_future()
            self._command(("install", name, weights, _threadsafe_setter(done)))
            await done
            self._registry[name] = AdapterRecord(name=name, path=weights.path, rank=weights.rank,
                                                 size_bytes=weights.size_bytes)
            logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)

    async def remove_adapter(self, name):
        """Unregister `name`; its slot frees once no running request uses it. Raises AdapterNotFound."""
        async with self._name_locks[name]:
            if name not in self._registry:
                raise AdapterNotFound(name)
            del self._registry[name]
            self._command(("release", name))
            logger.info("Removed LoRA adapter: name '%s'", name)

    def _command(self, command):
        with self._cond:
            self._commands.append(command)
            self._cond.notify_all()

    # ------------------------------------------------------------------ front: generation

    def check_prompt(self, prompt_ids, params):
        """Return an error message when the request cannot fit the context (never truncate), else None."""
        n = len(prompt_ids)
        if n >= self.max_model_len:
            return (f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                    f"has {n} input tokens. Please reduce the length of the input messages.")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            return (f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. This model's "
                    f"maximum context length is {self.max_model_len} tokens and your request has {n} input "
                    f"tokens ({params.max_tokens} > {self.max_model_len} - {n}).")
        return None

    async def generate(self, prompt_ids, params: SamplingParams, *, adapter=None, request_id=None):
        """Stream the completion of `prompt_ids`, one StepOutput per engine step.

        Raises AdapterNotFound for an unknown adapter, ValueError for a prompt that does not fit.
        """
        error = self.check_prompt(prompt_ids, params)
        if error:
            raise ValueError(error)
        adapter_path = None
        if adapter is not None:
            record = self._registry.get(adapter)
            if record is None:
                raise AdapterNotFound(adapter)
            adapter_path = record.path
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request = _Request(
            request_id=request_id or uuid.uuid4().hex, prompt_ids=list(prompt_ids), params=params,
            adapter=adapter, adapter_path=adapter_path,
            emit=_emitter(loop, queue))
        if adapter is not None:
            with self._slot_lock:
                resident = adapter in self._resident
            if not resident:  # evicted earlier: read it here, off the model thread
                request.weights = await asyncio.to_thread(self._read, adapter_path)
        with self._cond:
            self._waiting.append(request)
            self._cond.notify_all()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                with self._cond:
                    self._aborted.add(request.request_id)
                    self._cond.notify_all()

    async def complete(self, prompt_ids, params, *, adapter=None):
        """The whole completion: (text, token_ids, logprobs, finish_reason)."""
        text, ids, lps, finish = [], [], [], None
        async for out in self.generate(prompt_ids, params, adapter=adapter):
            text.append(out.text)
            ids += out.token_ids
            lps += out.logprobs
            finish = out.finish_reason
        return "".join(text), ids, lps, finish

    # ------------------------------------------------------------------ model thread

    def _loop(self):
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not (self._stop or self._commands or self._waiting or self._running or self._aborted):
                    self._cond.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
                aborted = set(self._aborted)
                self._aborted.clear()
            try:
                for command in commands:
                    self._run_command(command)
                if aborted:
                    self._drop_aborted(aborted)
                admitted = self._admit()
                if admitted:
                    self._prefill(admitted)
                    self._pace()
                elif self._running:
                    self._decode()
                    self._pace()
            except Exception as exc:  # keep serving: fail the batch in flight, not the process
                logger.exception("Engine step failed")
                for request in self._running + list(getattr(self, "_admitting", [])):
                    request.emit(RuntimeError(f"engine step failed: {exc}"))
                    self._finish_request(request)
                self._running, self._cache, self._mask = [], None, None
        for request in self._running + list(self._waiting):
            request.emit(RuntimeError("engine shut down"))

    def _pace(self):
        """Wait `step_delay` seconds before the next step; shutdown cuts the wait short.

        The wait runs on the model thread, so the asyncio front (HTTP, new requests, aborts) keeps
        going meanwhile; whatever arrives is handled at the next step.
        """
        if self.step_delay > 0:
            with self._cond:
                self._cond.wait_for(lambda: self._stop, timeout=self.step_delay)

    def _run_command(self, command):
        kind = command[0]
        if kind == "install":
            _, name, weights, notify = command
            try:
                with self._slot_lock:
                    self._install_locked(name, weights)
                notify(None)
            except Exception as exc:
                notify(exc)
        elif kind == "release":
            _, name = command
            with self._slot_lock:
                if name in self._resident:
                    if self._refcount[name] == 0:
                        self._free_slot_locked(name)
                    else:
                        # Running requests keep their slot under a tombstone key, so that the name
                        # can be loaded again (new files, new slot) while they finish.
                        tombstone = f"{name}#released-{next(self._tombstones)}"
                        self._resident[tombstone] = self._resident.pop(name)
                        self._refcount[tombstone] = self._refcount.pop(name)
                        self._released.add(tombstone)
                        for request in self._running:
                            if request.slot_key == name:
                                request.slot_key = tombstone

    def _install_locked(self, name, weights):
        """Write `weights` into a slot for `name`; returns the slot, or None when every slot is busy."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return self._resident[name]
        if not self._free_slots:
            victim = next((n for n in self._resident if self._refcount[n] == 0 and n not in self._released), None)
            if victim is None:
                return None
            self._free_slot_locked(victim)
            logger.info("Evicted LoRA adapter '%s' from its slot (LRU)", victim)
        slot = self._free_slots.pop()
        if slot >= self._slot_capacity or weights.rank > self._slot_rank:
            self._slot_capacity = max(self._slot_capacity, min(self.max_loras + 1, slot + SLOT_GROWTH))
            self._slot_rank = max(self._slot_rank, weights.rank)
        for module_name, (A, B) in weights.modules.items():
            layer = self._lora_layers[module_name]
            layer.reserve(self._slot_capacity, self._slot_rank)
            layer.write_slot(slot, A.to(self.device), B.to(self.device), weights.scaling)
        self._resident[name] = slot
        return slot

    def _free_slot_locked(self, name):
        slot = self._resident.pop(name)
        for layer in self._lora_layers.values():
            layer.clear_slot(slot)
        self._free_slots.append(slot)

    def _drop_aborted(self, aborted):
        self._waiting = collections.deque(r for r in self._waiting if r.request_id not in aborted)
        keep = [i for i, r in enumerate(self._running) if r.request_id not in aborted]
        for r in self._running:
            if r.request_id in aborted:
                self._finish_request(r)
        if len(keep) != len(self._running):
            self._keep_rows(keep)

    def _admit(self):
        """Take waiting requests into the batch, giving each a slot for its adapter."""
        admitted = []
        while self._waiting and len(self._running) + len(admitted) < self.max_batch:
            request = self._waiting[0]
            if request.adapter is not None:
                with self._slot_lock:
                    slot = self._resident.get(request.adapter)
                    if slot is None:
                        weights = request.weights or self._read(request.adapter_path)
                        slot = self._install_locked(request.adapter, weights)
                    if slot is None:
                        break  # every slot serves a running request; wait for one to finish
                    self._resident.move_to_end(request.adapter)
                    self._refcount[request.adapter] += 1
                request.slot, request.slot_key, request.weights = slot, request.adapter, None
            if request.params.seed is not None:
                request.generator = torch.Generator().manual_seed(request.params.seed)
            else:
                request.generator = torch.Generator().manual_seed(next(self._seed_source))
            self._waiting.popleft()
            admitted.append(request)
        return admitted

    def _prefill(self, requests):
        """Run the prompts of `requests` together, sample their first tokens, merge them into the batch."""
        self._admitting = requests
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            n = len(r.prompt_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_ids)
            mask[i, width - n:] = 1
            r.length = n
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._lora_batch.set([r.slot for r in requests])
        cache = DynamicCache()
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        logits = out.logits[:, -1, :]
        self._merge(requests, out.past_key_values, mask)
        self._admitting = []
        self._lora_batch.set([r.slot for r in self._running])
        self._sample_and_emit(self._running[-len(requests):], logits, first=True)

    def _merge(self, requests, cache, mask):
        """Append the prefilled rows to the running batch, left-padding whichever cache is shorter."""
        if not self._running:
            self._running, self._cache, self._mask = list(requests), cache, mask
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, width), _left_pad(new_layer.keys, width)], 0)
            old_layer.values = torch.cat([_left_pad(old_layer.values, width), _left_pad(new_layer.values, width)], 0)
        self._mask = torch.cat([_left_pad(self._mask, width, dim=1), _left_pad(mask, width, dim=1)], 0)
        self._running.extend(requests)

    def _keep_rows(self, keep):
        """Keep only the rows `keep` of the batch, and drop cache columns no row uses any more."""
        if not keep:
            self._running, self._cache, self._mask = [], None, None
            self._lora_batch.set([])
            return
        self._running = [self._running[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long)
        mask = self._mask.index_select(0, index)
        used = mask.any(0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self._mask = mask[:, start:]
        device_index = index.to(self.device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, device_index)[:, :, start:]
            layer.values = layer.values.index_select(0, device_index)[:, :, start:]
        self._lora_batch.set([r.slot for r in self._running])

    def _decode(self):
        """One decode step for every running request."""
        last = torch.tensor([[r.output_ids[-1]] for r in self._running], dtype=torch.long)
        # the last sampled token is not in the cache yet; its position is the sequence length - 1
        positions = torch.tensor([[r.length - 1] for r in self._running], dtype=torch.long)
        self._mask = torch.cat([self._mask, torch.ones((len(self._running), 1), dtype=torch.long)], 1)
        out = self.model(input_ids=last.to(self.device), attention_mask=self._mask.to(self.device),
                         position_ids=positions.to(self.device), past_key_values=self._cache, use_cache=True)
        self._cache = out.past_key_values
        self._sample_and_emit(self._running, out.logits[:, -1, :], first=False)

    def _sample_and_emit(self, rows, logits, *, first):
        # CPU-GPU sync point: sampling and stop checks run on the CPU
        logits = logits.float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)  # raw model logprobs, temperature 1
        greedy = logits.argmax(-1)
        finished = []
        for i, request in enumerate(rows):
            params = request.params
            if params.temperature <= 0:
                token = int(greedy[i])
            else:
                token = _sample(logits[i], params.temperature, params.top_p, request.generator)
            request.output_ids.append(token)
            request.length += 1
            self.generated_tokens += 1
            output = self._advance(request, token, float(logprobs[i, token]))
            if first:
                output.prompt_token_ids = request.prompt_ids
            if output.finish_reason is not None:
                finished.append(request)
            request.emit(output)
        self.steps += 1
        if finished:
            for request in finished:
                self._finish_request(request)
            self._keep_rows([i for i, r in enumerate(self._running) if not r.done])

    def _advance(self, request, token, logprob):
        """Detokenize, check stop conditions and build the StepOutput for one new token."""
        params = request.params
        finish, stop_reason = None, None
        if not params.ignore_eos and token in self.eos_token_ids:
            finish = "stop"
        elif token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        if params.stop and finish is None:
            # Search only where a stop string could newly end, then cut the text before it.
            start = max(0, request.sent_chars - max(len(s) for s in params.stop))
            hits = [(text.find(s, start), s) for s in params.stop if text.find(s, start) >= 0]
            if hits:
                cut, stop_reason = min(hits)
                text, finish = text[:cut], "stop"
        if finish is None and (len(request.output_ids) >= (params.max_tokens or self.max_model_len)
                               or request.length >= self.max_model_len):
            finish = "length"
        if finish is None:
            # Hold back a half-decoded character, and text that may be the start of a stop string.
            ready = len(text.rstrip("\ufffd"))
            if params.stop:
                ready = min(ready, len(text) - (max(len(s) for s in params.stop) - 1))
            ready = max(ready, request.sent_chars)
        else:
            ready = len(text)
        delta = text[request.sent_chars:ready]
        request.sent_chars = ready
        request.text = text
        return StepOutput(token_ids=[token], logprobs=[logprob], text=delta, finish_reason=finish,
                          stop_reason=stop_reason)

    def _finish_request(self, request):
        if request.done:
            return
        request.done = True
        key = request.slot_key
        if key is not None:
            with self._slot_lock:
                self._refcount[key] -= 1
                if self._refcount[key] <= 0:
                    del self._refcount[key]
                    if key in self._released:
                        self._released.discard(key)
                        self._free_slot_locked(key)


def _left_pad(tensor, width, dim=2):
    """Left-pad `tensor` with zeros along `dim` to `width`."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim)


def _sample(logits, temperature, top_p, generator):
    """Sample one token id from `logits` [vocab] with temperature and nucleus (top-p) filtering."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def _emitter(loop, queue):
    """A callable the model thread uses to hand outputs to the request's event loop."""
    def emit(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone; its abort is on the way
            pass

    return emit


def _threadsafe_setter(future):
    """A callable the model thread uses to complete an asyncio future (None = success)."""
    loop = future.get_loop()

    def notify(exc):
        def settle():
            if future.done():
                return
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)
        loop.call_soon_threadsafe(settle)

    return notify
