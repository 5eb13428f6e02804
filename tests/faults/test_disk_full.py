"""The disk fills up while a new adapter version is written: publishing fails with ENOSPC, nothing
half-written is left in ADAPTER_ROOT (no staging directory, no version row), and the previous
version stays active and loadable.

The full disk is real: ADAPTER_ROOT is a small tmpfs mounted for the test (root can mount one),
filled up to a few KB. Where mounting is not permitted, ENOSPC is raised at the copy of the
weights file instead (the same place a real full disk fails).
"""
import errno
import json
import os
import shutil
import subprocess

import pytest

from chat.tests.factories import AgentFactory
from serving import adapters
from serving import services as serving_services
from serving.models import AdapterVersion
from serving.tests.test_adapters import make_peft_dir

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory):
    # Rank 64 on every projection: ~60 KB of weights, far more than the room left on the disk.
    return make_peft_dir(tmp_path_factory.mktemp("peft") / "adapter", r=64,
                         target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture
def base_model(settings, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 16}))
    settings.MODEL, settings.SERVED_MODEL_NAME = str(model), "base"
    return model


@pytest.fixture
def small_disk(settings, tmp_path, peft_dir, monkeypatch):
    """ADAPTER_ROOT on a 1 MiB tmpfs; yields a function that fills it to `room` bytes free."""
    root = tmp_path / "small-disk"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)],
                             capture_output=True).returncode == 0
    settings.ADAPTER_ROOT = root

    def fill(room):
        if mounted:
            free = shutil.disk_usage(root).free
            with open(root / ".filler", "wb") as handle:
                handle.write(b"\0" * max(0, free - room))
            try:  # tmpfs counts pages: top up until the next write would not fit
                with open(root / ".filler", "ab") as handle:
                    while shutil.disk_usage(root).free > room:
                        handle.write(b"\0" * 4096)
                        handle.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        else:
            def copy_until_full(src, dst, length=0):
                dst.write(src.read(1024))
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(adapters.shutil, "copyfileobj", copy_until_full)

    try:
        yield fill
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(root)], check=False)


def test_publish_on_a_full_disk_fails_cleanly_and_keeps_the_active_version(user, peft_dir, base_model, small_disk,
                                                                           settings):
    agent = AgentFactory()
    weights_size = (peft_dir / adapters.WEIGHTS_FILE).stat().st_size
    assert weights_size > 32768, "the adapter must be bigger than the room left"
    previous = serving_services.publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=peft_dir)
    AdapterVersion.objects.filter(pk=previous.pk).update(is_active=True)  # as if hot-loaded earlier

    small_disk(room=4096)
    with pytest.raises(OSError) as failure:
        serving_services.publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=peft_dir)

    assert failure.value.errno == errno.ENOSPC
    assert list(AdapterVersion.objects.filter(user=user).values_list("number", flat=True)) == [1]
    left = sorted(p.name for p in settings.ADAPTER_ROOT.iterdir() if p.name != ".filler")
    assert left == [previous.name]  # no staging directory, no half-written version
    assert serving_services.active_version_for(user.pk, agent.pk) == previous
    adapters.verify(previous.path, previous.sha256)  # the active version's files are intact


def test_a_full_disk_really_refuses_writes(small_disk, settings):
    """Guards the test above: the tmpfs (when mounted) is really full."""
    small_disk(room=0)
    if not os.path.ismount(settings.ADAPTER_ROOT):
        pytest.skip("tmpfs could not be mounted here; ENOSPC was injected instead")
    with pytest.raises(OSError) as failure, open(settings.ADAPTER_ROOT / "more", "wb") as handle:
        handle.write(b"x" * 65536)
        handle.flush()
        os.fsync(handle.fileno())
    assert failure.value.errno == errno.ENOSPC
