"""Long phases' progress lines and the run's start summary."""

import dataclasses
import types

import pytest

from ragen_jax.config import summary as run_summary
from ragen_jax.config.resolve import resolve
from ragen_jax.config.schema import RunConfig
from ragen_jax.config.summary import accelerators_on_host, start_summary
from ragen_jax.progress import Phase, format_seconds


def test_format_seconds():
    assert format_seconds(5.4) == "5s"
    assert format_seconds(185) == "3m05s"
    assert format_seconds(3720) == "1h02m"


def test_phase_prints_a_start_line_and_five_milestones():
    lines = []
    with Phase("warm-start", 100, print_fn=lines.append, start_note="100 steps") as phase:
        for i in range(1, 101):
            phase.update(i, f"loss {1 / i:.2f}")
    assert lines[0] == "warm-start: 100 steps"
    assert [line.split(",")[0] for line in lines[1:]] == [
        "warm-start: 20/100", "warm-start: 40/100", "warm-start: 60/100", "warm-start: 80/100",
        "warm-start: 100/100"]
    assert "left)" in lines[1] and "left" not in lines[-1]


def test_phase_without_total_prints_only_its_start():
    lines = []
    with Phase("validation at step 0", None, print_fn=lines.append) as phase:
        phase.update(3)
    assert lines == ["validation at step 0 ..."]


def test_phase_on_a_terminal_is_a_task_of_the_display():
    tasks = {}
    progress = types.SimpleNamespace(
        console=types.SimpleNamespace(is_terminal=True),
        add_task=lambda what, total, info: tasks.setdefault(1, [what, total, 0]) and 1,
        update=lambda task, completed, info: tasks[task].__setitem__(2, completed),
        remove_task=lambda task: tasks.pop(task))
    lines = []
    phase = Phase("warm-start", 10, progress=progress, print_fn=lines.append)
    phase.update(4)
    assert tasks[1] == ["warm-start", 10, 4] and not lines
    phase.close()
    assert not tasks


def test_start_summary_is_short_and_says_where_things_go(tmp_path, monkeypatch):
    monkeypatch.setattr(run_summary, "accelerators_on_host", lambda: None)
    run = RunConfig(trainer=dataclasses.replace(RunConfig().trainer, output_dir=str(tmp_path)))
    text = start_summary(resolve(run), [types.SimpleNamespace(platform="cpu")])
    lines = text.splitlines()
    assert len(lines) <= 12
    assert lines[0].startswith("ragen_jax: sokoban")
    assert any(str(tmp_path) in line for line in lines)
    assert any("config.json" in line and "--print_config" in line for line in lines)
    assert any("gae" in line for line in lines)
    assert "  compute      float32 (model.dtype=float32, on XLA:CPU)" in lines



@pytest.mark.parametrize("found,platform,warned", [
    (("8 NVIDIA GPUs", "cuda12"), "cpu", True),
    (("4 TPU chips", "tpu"), "cpu", True),
    (("8 NVIDIA GPUs", "cuda12"), "gpu", False),  # jax runs on them
    (None, "cpu", False),  # a CPU machine
])
def test_start_summary_warns_of_an_accelerator_jax_does_not_use(tmp_path, monkeypatch, found,
                                                                platform, warned):
    monkeypatch.setattr(run_summary, "accelerators_on_host", lambda: found)
    run = RunConfig(trainer=dataclasses.replace(RunConfig().trainer, output_dir=str(tmp_path)))
    lines = start_summary(resolve(run), [types.SimpleNamespace(platform=platform)]).splitlines()
    warnings = [line for line in lines if line.lstrip().startswith("warning")]
    assert len(lines) <= 12
    if not warned:
        assert not warnings
        return
    what, extra = found
    assert len(warnings) == 1, lines
    assert f"{what} here, but jax runs on the CPU" in warnings[0]
    assert f'pip install -e ".[{extra}]"' in warnings[0]
    assert "docs/accelerators.md" in warnings[0]


def _fake_host(tmp_path, dev_nodes=(), pci=()):
    """A /dev with ``dev_nodes`` and a /sys/bus/pci/devices with one folder per ``(vendor,
    device)`` id pair."""
    dev, bus = tmp_path / "dev", tmp_path / "pci"
    dev.mkdir()
    bus.mkdir()
    for name in dev_nodes:
        (dev / name).touch()
    for i, (vendor, device) in enumerate(pci):
        d = bus / f"0000:00:{i:02x}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return {"dev": str(dev), "pci": str(bus)}


GVNIC = ("0x1ae0", "0x0042")  # Google's virtual NIC: Google's vendor id, not a TPU
VIRTIO = ("0x1af4", "0x1000")


@pytest.mark.parametrize("dev_nodes,pci,env,expected", [
    (("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"), (VIRTIO,), {}, ("2 NVIDIA GPUs", "cuda12")),
    (("nvidia0",), (), {"CUDA_VISIBLE_DEVICES": "0"}, ("1 NVIDIA GPU", "cuda12")),
    (("nvidia0",), (), {"CUDA_VISIBLE_DEVICES": ""}, None),  # every GPU hidden
    (("nvidia0",), (), {"CUDA_VISIBLE_DEVICES": "-1"}, None),
    (("nvidia0",), (), {"JAX_PLATFORMS": "cpu"}, None),  # the run asked for the CPU
    (("nvidia0",), (), {"JAX_PLATFORMS": "cuda,cpu"}, ("1 NVIDIA GPU", "cuda12")),
    (("nvidiactl", "nvidia-uvm"), (), {}, None),  # the driver's control nodes, no GPU given
    ((), (("0x1ae0", "0x0063"),) * 4 + (GVNIC,), {}, ("4 TPU chips", "tpu")),  # a v5e host
    ((), (("0x1ae0", "0x005e"),), {}, ("1 TPU chip", "tpu")),  # v4
    ((), (GVNIC, VIRTIO), {}, None),  # a Google Cloud VM without a TPU
    (("accel0",), (), {"TPU_ACCELERATOR_TYPE": "v4-8"}, None),  # traces only
    ((), (("0x8086", "0x0063"),), {}, None),  # a TPU's device id under another vendor
])
def test_accelerators_on_host(tmp_path, dev_nodes, pci, env, expected):
    assert accelerators_on_host(**_fake_host(tmp_path, dev_nodes, pci), env=env) == expected


def test_accelerators_on_host_without_dev_or_sys(tmp_path):
    assert accelerators_on_host(str(tmp_path / "none"), str(tmp_path / "none"), env={}) is None
