"""The few lines a run prints when it starts, and the full settings it writes beside them.

A run's start says what will happen (env, model, algorithm, steps, devices) and where
everything goes, in about ten lines; the whole config (``config.json``) and the derived
settings (``settings.txt``, ``resolve.describe``) are files of the run folder, printed in full
only on request (``launch.py --print_config``), because two hundred lines of YAML before
anything happens hide the lines that matter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ragen_jax.config.resolve import Resolved, describe
from ragen_jax.config.schema import compute_dtype

SETTINGS_FILE = "settings.txt"  # the run folder's derived settings (resolve.describe)
# A derived note that changes a value the config gave ("algorithm.loss_agg_mode = ..."): the
# one kind of note a run prints at its start, since the run then differs from the file.
_CHANGED_FIELD = re.compile(r"^\w+\.\w+ = ")


def _n(count: int, word: str) -> str:
    """``count word`` with the plural ``s`` when it is not 1."""
    return f"{count} {word}" + ("" if count == 1 else "s")


def _model_line(plan: Resolved) -> str:
    m = plan.run.model
    if m.path:
        what = Path(m.path).name or m.path
    else:
        what = f"tiny random model ({m.num_hidden_layers} layers, width {m.hidden_size})"
    return f"{what}, " + (f"LoRA rank {m.lora_rank}" if m.lora_rank else "full fine-tuning")


def _env_line(plan: Resolved) -> str:
    r = plan.rollout
    trained = [e.tag or e.name for e in plan.envs if e.groups]
    held = [e.tag or e.name for e in plan.envs if not e.groups]
    line = (f"{', '.join(trained)}: {r.env_groups} groups x {r.group_size} = "
            f"{_n(r.env_groups * r.group_size, 'episode')} a step, up to {_n(r.max_turn, 'turn')} each")
    return line + (f"; validation only: {', '.join(held)}" if held else "")


def _prior_line(plan: Resolved) -> str | None:
    run = plan.run
    w, parts = run.warmstart, []
    if run.sft.steps:
        parts.append(f"SFT {run.sft.steps} steps on {run.sft.data}")
    if w.steps or w.turns.steps:
        steps = w.steps + w.turns.steps
        cached = not run.model.path and not run.model.lora_rank and w.cache
        parts.append(f"warm-start {steps} supervised steps on ~{w.episodes} scripted episodes"
                     + (" (built on first use, then cached)" if cached else ""))
    return "; ".join(parts) or None


# Google's PCI vendor id, and the PCI device ids of its TPU chips (v2/v3, an unnamed one, v4,
# v5p, v5e, v6e, 7x): the table jax keeps for the same purpose (jax._src.hardware_utils).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")


def accelerators_on_host(dev: str = "/dev", pci: str = "/sys/bus/pci/devices",
                         env: dict[str, str] | None = None) -> tuple[str, str] | None:
    """The accelerators this machine gives this process, whatever jax runs on:
    ``("8 NVIDIA GPUs", "cuda12")`` / ``("4 TPU chips", "tpu")`` (what there is, and the
    setup.cfg extra that installs jax for it), or None.

    Conservative: it looks for what a process can use, not for traces of a driver, so that a
    CPU run is never told of hardware it cannot reach.

    - NVIDIA: the device nodes ``/dev/nvidia0``, ``/dev/nvidia1``, ... (one per GPU; a container
      gets those of the GPUs passed to it). Not ``/proc/driver/nvidia/version``: ``/proc/driver``
      is the host kernel's, visible in a container given no GPU; not ``nvidia-smi`` on PATH: a
      tool, installed in images that run without a GPU. Not when ``CUDA_VISIBLE_DEVICES`` hides
      every GPU ("" or "-1").
    - TPU: PCI devices of Google's vendor id whose device id is a TPU chip's (the table jax
      uses). Not the vendor id alone (gVNIC, the virtual NIC of Google Cloud VMs, has it too),
      not ``/dev/accel*`` alone (Linux's accel subsystem serves other NPUs) nor ``TPU_*``
      variables (copied into images and shells).
    - Nothing when ``JAX_PLATFORMS`` is set without ``cuda`` / ``gpu`` / ``tpu``: the run asked
      for the CPU.
    """
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "tpu")):
        return None
    try:
        gpus = [n for n in os.listdir(dev) if re.fullmatch(r"nvidia\d+", n)]
    except OSError:
        gpus = []
    if gpus and env.get("CUDA_VISIBLE_DEVICES", "unset").strip() not in ("", "-1"):
        return _n(len(gpus), "NVIDIA GPU"), "cuda12"
    chips = 0
    for device in sorted(Path(pci).glob("*")):
        try:
            vendor = (device / "vendor").read_text().strip()
            chips += vendor == GOOGLE_PCI_VENDOR and (
                (device / "device").read_text().strip() in TPU_PCI_DEVICES)
        except OSError:
            continue
    if chips:
        return _n(chips, "TPU chip"), "tpu"
    return None


def _accelerator_warning(backend: str) -> str | None:
    """One line when jax runs on the CPU of a machine with GPUs or TPUs (``pip install jax``
    alone installs a CPU-only jaxlib), saying how to install for them."""
    found = accelerators_on_host() if backend == "cpu" else None
    if found is None:
        return None
    what, extra = found
    return (f"{what} here, but jax runs on the CPU: pip install -e \".[{extra}]\" "
            f"(docs/accelerators.md); if that is installed, jax's log above says why it did "
            f"not start; JAX_PLATFORMS=cpu if the CPU is meant")


def _devices_line(devices: list[Any], processes: int, mesh: Any) -> str:
    platform = devices[0].platform if devices else "?"
    data = mesh.data or max(1, len(devices) // (mesh.fsdp * mesh.tensor))
    return (f"{_n(len(devices), platform + ' device')}, "
            f"{processes} process{'' if processes == 1 else 'es'}; mesh data {data} x "
            f"fsdp {mesh.fsdp} x tensor {mesh.tensor}")


def start_summary(plan: Resolved, devices: list[Any], processes: int = 1,
                  backend: str | None = None, memory: str | None = None) -> str:
    """The run's start, about ten lines: what trains on what, where it goes, and the derived
    notes that change a configured value. ``devices``: ``jax.devices()``; ``memory``: the
    warning of ``budget.check_run``, when the run may not fit."""
    run, tr = plan.run, plan.run.trainer
    backend = backend or (devices[0].platform if devices else "cpu")
    val = sum(e.val_groups for e in plan.envs) * plan.rollout.val.group_size
    a = run.algorithm
    rows = [
        ("env", _env_line(plan)),
        ("model", _model_line(plan)),
        # which dtype ``auto`` took on this backend, and why (before the model is built in it)
        ("compute", compute_dtype(run.model, backend)[1].removeprefix("compute dtype: ")),
        ("algorithm", f"{a.adv_estimator}, lr {run.actor.lr:g}, filter {run.filter.strategy} "
                      f"{run.filter.value:g} by {run.filter.metric}"),
        ("steps", f"{_n(tr.total_steps, 'training step')}; validation on {_n(val, 'episode')} "
                  f"every {_n(tr.test_freq, 'step')}" + (" and at step 0" if tr.val_before_train else "")
                  + f"; checkpoint every {tr.save_freq}"),
        ("prior", _prior_line(plan)),
        ("devices", _devices_line(devices, processes, run.mesh)),
        ("warning", _accelerator_warning(backend)),
        ("warning", memory and f"memory: {memory}"),
        ("run folder", f"{plan.output_dir}/ (rerun the same command to resume)"),
        ("full config", f"{SETTINGS_FILE} and config.json there (launch.py --print_config "
                        f"prints both)"),
    ]
    rows += [("note", n) for n in plan.notes if _CHANGED_FIELD.match(n)]
    width = max(len(k) for k, v in rows if v)
    lines = [f"ragen_jax: {run.env.name if not run.env.mix else 'env mix'}, preset {run.preset}"]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows if v]
    return "\n".join(lines)


def full_settings(plan: Resolved, backend: str) -> str:
    """The derived settings with the compute dtype's reason (the run folder's
    ``settings.txt``, and what ``--print_config`` adds to the YAML)."""
    return compute_dtype(plan.run.model, backend)[1] + "\n" + describe(plan) + "\n"
