"""Long phases' progress lines and the run's start summary."""

import dataclasses
import types

from ragen_jax.progress import Phase, format_seconds
from ragen_jax.run_summary import start_summary
from ragen_jax.schema import RunConfig, resolve


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


def test_start_summary_is_short_and_says_where_things_go(tmp_path):
    run = RunConfig(trainer=dataclasses.replace(RunConfig().trainer, output_dir=str(tmp_path)))
    text = start_summary(resolve(run), [types.SimpleNamespace(platform="cpu")])
    lines = text.splitlines()
    assert len(lines) <= 12
    assert lines[0].startswith("ragen_jax: sokoban")
    assert any(str(tmp_path) in line for line in lines)
    assert any("config.json" in line and "--print_config" in line for line in lines)
    assert any("gae" in line for line in lines)
    assert "  compute      float32 (model.dtype=float32, on XLA:CPU)" in lines

