"""The adapter registry's operations: publish a version, activate it everywhere, roll back.

Serving refers to users and agents by id and imports neither `chat` nor `training`; training
writes the audit events around these calls.
"""
import functools
import hashlib
import logging
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Max
from django.utils import timezone

from serving.adapters import (  # noqa: F401  (re-exported: callers catch them from here)
    AdapterIntegrityError,
    InvalidAdapterError,
    adapter_path,
    delete_adapter,
    verify,
    write_adapter,
)
from serving.client import InferenceFailure, get_client
from serving.models import AdapterVersion, adapter_name

logger = logging.getLogger(__name__)

PUBLISH_ATTEMPTS = 3


class IncompatibleAdapterError(Exception):
    """The version was trained on another base model than the one served now."""


# BASE MODEL
# ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _identity(model, served_name):
    config = Path(model) / "config.json"
    if config.is_file():
        return served_name, hashlib.sha256(config.read_bytes()).hexdigest()
    # MODEL names a checkpoint this process has no copy of (e.g. a hub id served by vLLM only).
    logger.warning("MODEL %s has no local config.json; identifying the base model by its name", model)
    return served_name, hashlib.sha256(f"model:{model}".encode()).hexdigest()


def base_model_identity():
    """(served model name, sha256 of MODEL's config.json): what a version must have been trained on."""
    return _identity(str(settings.MODEL), settings.SERVED_MODEL_NAME)


# READING THE REGISTRY
# ------------------------------------------------------------------------------


def _serveable(version):
    if version is None or version.state != AdapterVersion.State.READY:
        return None
    return version if version.is_compatible_with(*base_model_identity()) else None


def active_version_for(user_id, agent_id):
    """The active version of (user, agent) if it can be served on the current base model, else None (base)."""
    return _serveable(AdapterVersion.objects.for_pair(user_id, agent_id).active().first())


async def aactive_version_for(user_id, agent_id):
    return _serveable(await AdapterVersion.objects.for_pair(user_id, agent_id).active().afirst())


def incompatible_versions_for(user_id, agent_id):
    """Versions of (user, agent) trained on another base model: never served; the UI says why."""
    _, base_hash = base_model_identity()
    return AdapterVersion.objects.for_pair(user_id, agent_id).exclude(base_model_hash=base_hash)


# PUBLISHING
# ------------------------------------------------------------------------------


def _lock_pair(user_id, agent_id):
    """Serialize publish/activate for one (user, agent) until the transaction ends.

    An advisory lock rather than a row lock: the pair may have no row yet to lock.
    """
    digest = hashlib.sha256(f"serving.adapters:{user_id}:{agent_id}".encode()).digest()
    key = int.from_bytes(digest[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


def publish_version(*, user_id, agent_id, source_dir, parent=None, config=None, metrics=None):
    """Store a trained PEFT directory as the pair's next version (inactive).

    Args:
        user_id, agent_id: whose adapter it is.
        source_dir: a directory written by `PeftModel.save_pretrained`; it is copied, not consumed.
        parent: the AdapterVersion (or its id) it was trained from, or None (from base).
        config, metrics: the training config and metrics, stored on the row.

    Returns:
        The new AdapterVersion, with sha256, size and the base model's name and config hash.

    Raises:
        InvalidAdapterError: vLLM could not load the directory unchanged.
    """
    base_name, base_hash = base_model_identity()
    parent_id = parent.pk if isinstance(parent, AdapterVersion) else parent
    for attempt in range(PUBLISH_ATTEMPTS):
        try:
            with transaction.atomic():
                _lock_pair(user_id, agent_id)
                last = AdapterVersion.objects.for_pair(user_id, agent_id).aggregate(n=Max("number"))["n"] or 0
                name = adapter_name(user_id, agent_id, last + 1)
                if adapter_path(name).exists() and not AdapterVersion.objects.filter(name=name).exists():
                    # Left by a publisher that died between its rename and its commit. We hold the
                    # pair's lock, so no live publisher is writing it.
                    logger.warning("Removing orphaned adapter directory %s", name)
                    delete_adapter(name)
                stored = write_adapter(name, source_dir, base_model_name=base_name)
                try:
                    return AdapterVersion.objects.create(
                        user_id=user_id,
                        agent_id=agent_id,
                        number=last + 1,
                        name=name,
                        parent_id=parent_id,
                        path=str(stored.path),
                        sha256=stored.sha256,
                        size_bytes=stored.size_bytes,
                        base_model_name=base_name,
                        base_model_hash=base_hash,
                        config=config or {},
                        metrics=metrics or {},
                    )
                except BaseException:
                    delete_adapter(name)
                    raise
        except IntegrityError:
            # Another publisher outside our lock (e.g. a manual insert) took the number: next one.
            if attempt == PUBLISH_ATTEMPTS - 1:
                raise
            logger.warning("Version number for user %s agent %s was taken; retrying", user_id, agent_id)


# ACTIVATION
# ------------------------------------------------------------------------------


def _check_activatable(version, user_id, agent_id):
    if version.user_id != user_id or version.agent_id != agent_id:
        raise ValueError(f"{version.name} does not belong to user {user_id}, agent {agent_id}.")
    if version.state != AdapterVersion.State.READY:
        raise AdapterIntegrityError(f"Adapter {version.name}'s files were deleted; it cannot be activated.")
    base_name, base_hash = base_model_identity()
    if not version.is_compatible_with(base_name, base_hash):
        raise IncompatibleAdapterError(
            f"{version.name} was trained on base model {version.base_model_name!r} "
            f"(config {version.base_model_hash[:12]}), not the one served now "
            f"({base_name!r}, config {base_hash[:12]})."
        )
    verify(version.path, version.sha256)


def activate_version(version, *, user_id, agent_id, actor_label="", client=None):
    """Make `version` the one (user, agent)'s next request uses; None resets them to the base model.

    Order: verify the files, hot-load on every replica (any failure: nothing changes), flip
    `is_active` in one transaction, then after commit unload the previous version from the
    replicas (best effort). Rollback is this call with an older version.

    Raises:
        AdapterIntegrityError: the files don't match the recorded sha256; the previous version stays.
        IncompatibleAdapterError: trained on another base model.
        InferenceUnavailable / InferenceError: a replica could not load it; nothing changed.
    """
    client = client or get_client()
    if version is not None:
        version = AdapterVersion.objects.get(pk=version.pk)  # state and files as they are now
        _check_activatable(version, user_id, agent_id)
        client.load_adapter_sync(version.name, version.path)
    try:
        with transaction.atomic():
            _lock_pair(user_id, agent_id)
            previous = list(AdapterVersion.objects.for_pair(user_id, agent_id).active().select_for_update())
            if version is not None and [p.pk for p in previous] == [version.pk]:
                return version
            # Deactivate first: the one-active-version constraint is checked per statement.
            AdapterVersion.objects.filter(pk__in=[p.pk for p in previous]).update(is_active=False)
            if version is not None:
                version.is_active = True
                version.activated_at = timezone.now()
                version.activated_by = actor_label[:150]
                version.save(update_fields=["is_active", "activated_at", "activated_by"])
            stale = [p.name for p in previous]
            transaction.on_commit(lambda: _unload_quietly(client, stale))
    except BaseException:
        if version is not None:
            _unload_quietly(client, [version.name])
        raise
    logger.info("Activated %s for user %s agent %s (by %s)", version or "base", user_id, agent_id, actor_label)
    return version


def _unload_quietly(client, names):
    for name in names:
        try:
            client.unload_adapter_sync(name)
        except Exception:  # best effort: an unloaded adapter is only memory, evicted by the LRU anyway
            logger.exception("Could not unload %s", name)


def rollback(*, user_id, agent_id, to=None, actor_label="", client=None):
    """Activate `to`, or else the newest servable version older than the active one (base if none)."""
    if to is None:
        current = active_version_for(user_id, agent_id)
        older = AdapterVersion.objects.for_pair(user_id, agent_id).filter(
            state=AdapterVersion.State.READY, base_model_hash=base_model_identity()[1]
        )
        if current is not None:
            older = older.filter(number__lt=current.number)
        to = older.order_by("-number").first()
    return activate_version(to, user_id=user_id, agent_id=agent_id, actor_label=actor_label, client=client)


# REPLICAS
# ------------------------------------------------------------------------------


def serveable_active_versions():
    _, base_hash = base_model_identity()
    return AdapterVersion.objects.active().filter(state=AdapterVersion.State.READY, base_model_hash=base_hash)


def ensure_replica_adapters(client=None):
    """Load every active adapter onto the replicas that lack it (a replica restarted, a new one joined).

    Run on startup of web and workers. Returns {url: [names loaded]}; replicas that are down are skipped.
    """
    client = client or get_client()
    health = client.health_sync()
    active = list(serveable_active_versions())
    loaded = {}
    for url, state in health.items():
        loaded[url] = []
        if not state["ok"]:
            logger.warning("Replica %s is down (%s); its adapters will be restored on demand", url, state["error"])
            continue
        for version in active:
            if version.name in state["adapters"]:
                continue
            try:
                verify(version.path, version.sha256)
                client.load_adapter_sync(version.name, version.path, urls=[url])
            except (AdapterIntegrityError, InferenceFailure) as exc:
                logger.error("Could not restore %s on %s: %s", version.name, url, exc)
                continue
            loaded[url].append(version.name)
    return loaded


def _verified_serveable(name):
    """The version named `name` if it may be served and its files verify, else None.

    Runs in a worker thread of its own and closes that thread's connection, so the hook leaves
    no connection behind in whatever thread pool called it.
    """
    try:
        version = _serveable(AdapterVersion.objects.filter(name=name).first())
        if version is not None:
            verify(version.path, version.sha256)
        return version
    except AdapterIntegrityError as exc:
        logger.error("Not restoring %s: %s", name, exc)
        return None
    finally:
        connection.close()


async def arestore_adapter(client, url, name):
    """The client's reload-on-404 hook: load version `name` on replica `url` from the store.

    Only a READY version compatible with the current base whose files verify is loaded. Requests
    are made with the name `aactive_version_for` returned, so this may be a version deactivated a
    moment ago; loading it under its own name again is a fresh load, never an in-place reload.
    """
    version = await sync_to_async(_verified_serveable, thread_sensitive=False)(name)
    if version is None:
        return False
    try:
        await client.load_adapter(name, version.path, urls=[url])
    except InferenceFailure as exc:
        logger.error("Could not restore %s on %s: %s", name, url, exc)
        return False
    return True
