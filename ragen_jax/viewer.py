"""A static HTML page of episodes (the trajectory viewer of evaluation and validation).

Model text is untrusted: every interpolated string goes through ``html.escape``, so the page
runs no script whatever the model wrote.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any


def render_html(trajectories: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    """A static page: metrics, then per episode and turn the prompt text the model saw
    before the turn (collapsed: the system and first user message on turn 1, then the
    reward and next user message), the state, thinking, raw response, actions and reward.

    Everything interpolated is passed through ``html.escape`` (model and env text is
    untrusted).
    """
    e = lambda x: html.escape(str(x), quote=True)  # noqa: E731
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ragen_jax eval</title><style>",
        "body{font-family:sans-serif;margin:1em}pre{background:#f4f4f4;padding:4px;margin:2px}"
        "details{border:1px solid #ccc;margin:4px;padding:4px}.ok{color:#080}.bad{color:#a00}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}",
        "</style></head><body>",
        f"<h1>{e(summary.get('model', ''))} on {e(summary.get('env', ''))}</h1><table>",
    ]
    for k, v in sorted(summary.get("metrics", {}).items()):
        parts.append(f"<tr><td>{e(k)}</td><td>{e(f'{v:.4g}' if isinstance(v, float) else v)}</td></tr>")
    parts.append("</table>")
    for traj in trajectories:
        cls = "ok" if traj.get("success") else "bad"
        parts.append(
            f"<details><summary class='{cls}'>{e(traj.get('tag', ''))} env {e(traj.get('env_id'))} (group "
            f"{e(traj.get('group_id'))}, seed {e(traj.get('seed'))}): success "
            f"{e(traj.get('success'))}, score {e(round(float(traj.get('score', 0.0)), 4))}, "
            f"actions {e(traj.get('num_actions'))}</summary>")
        for t in traj.get("turns", []):
            parts.append(f"<h4>Turn {e(t.get('turn'))}</h4>")
            if "prompt" in t:
                parts.append(f"<details><summary>prompt</summary><pre>{e(t['prompt'])}</pre>"
                             "</details>")
            parts.append(f"<pre>{e(t.get('state', ''))}</pre>")
            parts.append(f"<p><b>thinking</b></p><pre>{e(t.get('think', ''))}</pre>")
            parts.append(f"<p><b>raw response</b></p><pre>{e(t.get('response', ''))}</pre>")
            parts.append(
                f"<p><b>actions</b> {e(t.get('actions', []))} executed "
                f"{e(t.get('executed', []))}; reward {e(t.get('reward', ''))}, penalty "
                f"{e(t.get('penalty', ''))} {e(t.get('format_error', ''))}"
                f"{'' if t.get('stopped', True) else ' (cut at the token budget)'}</p>")
            if t.get("env_error"):
                parts.append(f"<p class='bad'><b>env failed</b> {e(t['env_error'])}</p>")
        if traj.get("env_error") and not traj.get("turns"):
            parts.append(f"<p class='bad'><b>env failed</b> {e(traj['env_error'])}</p>")
        parts.append(f"<h4>Final state</h4><pre>{e(traj.get('final_state', ''))}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)
