"""The HTTP env trains: a tiny 2-step Countdown run whose env is served by a separate
``python -m ragen_jax.envs.host.serve`` process equals the same run with Countdown in-process.

"Equal" is exact: every metric of every step (timings aside: the warm-start's losses, the
training batches' scores, successes and lengths, the update's losses and gradient norms, the
validation's metrics) is the same float, and the validation episodes written (prompts,
answers, rewards, levels) are the same JSON. The run includes the format warm-start, whose
random answers come from the served env's ``random_action`` with the client's generator
state, and validation with held-out levels (the served level keys).
"""

from __future__ import annotations

import json

import pytest

from ragen_jax.metrics import read_jsonl
from tests.rollout.test_remote_env import _port, _serve
from tests.test_train import _run, _without_timing, micro_config

PARAMS = ("min_numbers=3", "max_numbers=4", "max_number=99", "max_target=100")  # the preset's


def _config(out, url=None):
    config = micro_config(out, steps=2, env="countdown", extra=(
        "--config.trainer.val_before_train=False", "--config.trainer.save_freq=2",
        "--config.warmstart.steps=2", "--config.rollout.response_length=32"))
    assert sorted(f"{k}={v}" for k, v in config.env.params.items()) == sorted(PARAMS)
    if url is not None:
        config.env.name, config.env.params = "remote", {"url": url}
    return config


def _trajectories(out):
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted((out / "trajectories").glob("*.jsonl"))}


@pytest.mark.timeout(300)
def test_a_countdown_run_against_a_served_env_equals_the_in_process_run(tmp_path):
    port = _port()
    server = _serve("countdown", port, *[a for p in PARAMS for a in ("--param", p)])
    try:
        local, remote = tmp_path / "local", tmp_path / "remote"
        assert _run(_config(local))["step"] == 2
        assert _run(_config(remote, f"http://127.0.0.1:{port}"))["step"] == 2
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()
    ours, served = read_jsonl(local / "metrics.jsonl"), read_jsonl(remote / "metrics.jsonl")
    assert sorted(ours) == [0, 1, 2] and "val-env/Countdown/success" in ours[2]
    assert ours[0]["warmstart/loss_last"] > 0  # the warm-start ran, on the served answers
    assert _without_timing(ours) == _without_timing(served)
    trajectories = _trajectories(local)
    assert list(trajectories) == ["val_step00002.jsonl"] and len(trajectories["val_step00002.jsonl"]) == 4
    assert trajectories == _trajectories(remote)


def test_the_remote_config_takes_an_env_configs_settings(tmp_path):
    """``configs/remote.py:countdown`` is Countdown's run with the env served: the same
    settings but the env, which the command line points at a server."""
    from ragen_jax.config.loading import from_config_dict, load_config

    served = load_config(["--config=configs/remote.py:countdown",
                          "--config.env.params.url=http://127.0.0.1:9"], prog="t")
    local = load_config(["--config=configs/countdown.py"], prog="t")
    assert served.env.name == "remote" and dict(served.env.params) == {"url": "http://127.0.0.1:9"}
    for section in ("rollout", "algorithm", "actor", "warmstart", "trainer"):
        assert served[section].to_dict() == local[section].to_dict(), section
    from_config_dict(served)  # every field valid
    with pytest.raises(ValueError, match="no env config configs/nosuchenv.py"):
        load_config(["--config=configs/remote.py:nosuchenv"], prog="t")
