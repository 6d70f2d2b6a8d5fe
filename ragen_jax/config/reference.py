"""The configuration reference, generated from the schema's source.

Every run-config field is a dataclass field whose trailing comment is its user
documentation (``config/schema.py`` and the sections it collects, e.g. ``RolloutConfig``). This
module reads those comments back from the source (``ast`` for the fields, ``tokenize`` for the
comments) so the documentation site's reference is never a hand-copied table that drifts;
``missing_docs`` lists the fields without a comment (a test keeps it empty).

    python -m ragen_jax.config.reference > configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

from ragen_jax.config.schema import EnvConfig, MixEntry, RunConfig


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One config field as the reference shows it."""

    name: str  # the command-line path, e.g. "rollout.max_turn"
    type: str
    default: Any
    doc: str  # its trailing comment ("" when it has none)


def _comments(source: str) -> dict[int, str]:
    """``{line number: comment text}`` of a module's source (1-based, the ``#`` dropped)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_comments(cls: type) -> dict[str, str]:
    """``{field: trailing comment}`` of a dataclass, read from its module's source: the
    comment on the last line of the field's statement ("" when there is none)."""
    file = inspect.getsourcefile(cls)
    source = Path(file).read_text(encoding="utf-8")
    comments = _comments(source)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return {stmt.target.id: comments.get(stmt.end_lineno, "")
                    for stmt in node.body
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
    raise LookupError(f"class {cls.__name__} not found in {file}")


def _type_name(hint: Any) -> str:
    name = getattr(hint, "__name__", None)
    return name if name and not typing.get_args(hint) else str(hint).replace("typing.", "")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def section_fields(prefix: str, cls: type) -> list[FieldDoc]:
    """The fields of one config section (a dataclass) that are values, each named
    ``prefix.field`` (its nested sections are sections of their own)."""
    comments, hints = field_comments(cls), typing.get_type_hints(cls)
    return [FieldDoc(f"{prefix}.{f.name}" if prefix else f.name, _type_name(hints[f.name]),
                     _default(f), comments.get(f.name, ""))
            for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]


def _subsections(prefix: str, cls: type) -> list[tuple[str, type]]:
    """``cls`` as the section ``prefix``, then its nested sections (``rollout.sampling``)."""
    out = [(prefix, cls)]
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out += _subsections(f"{prefix}.{name}", hint)
    return out


def sections() -> list[tuple[str, type | None]]:
    """The reference's sections in order: ``("", None)`` for the top-level fields, then
    each ``RunConfig`` section followed by its nested ones, with ``env.mix[i]``'s entries
    after ``env``."""
    out: list[tuple[str, type | None]] = [("", None)]
    for f in dataclasses.fields(RunConfig):
        cls = typing.get_type_hints(RunConfig)[f.name]
        if dataclasses.is_dataclass(cls):
            out += _subsections(f.name, cls)
            if cls is EnvConfig:
                out.append(("env.mix[i]", MixEntry))
    return out


def top_level_fields() -> list[FieldDoc]:
    """``RunConfig``'s own fields that are values, not sections (``seed``, ``preset``)."""
    return section_fields("", RunConfig)


def all_fields() -> list[FieldDoc]:
    """Every field of the run config, in the reference's order."""
    out = []
    for prefix, cls in sections():
        out += top_level_fields() if cls is None else section_fields(prefix, cls)
    return out


def missing_docs() -> list[str]:
    """The fields that have no doc comment (the reference would show them blank)."""
    return [d.name for d in all_fields() if not d.doc]


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, backticks kept balanced."""
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    """A default as inline code (repr, so strings show their quotes)."""
    text = repr(value)
    fence = "``" if "`" in text else "`"
    return f"{fence}{_cell(text)}{fence}"


def _docstring(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return doc if not doc.startswith(f"{cls.__name__}(") else ""  # dataclass' generated one


def reference_markdown() -> str:
    """The configuration reference page: one table per section, every field with its type,
    default and comment, in the schema's order."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema's source when the site is built "
        "(`ragen_jax/config/reference.py` reads each field's trailing comment); do not edit "
        "by hand. Any field can be set on the command line as "
        "`--config.<section>.<field>=value`; a preset file (`configs/*.py`) sets its own "
        "values over these defaults. \"RAGEN: x\" gives RAGEN's value where it has the "
        "setting.",
        "",
    ]
    for prefix, cls in sections():
        title = f"`config.{prefix}`" if prefix else "Top level"
        lines += [f"## {title}", ""]
        if cls is not None and _docstring(cls):
            lines += [textwrap.dedent(_docstring(cls)).replace("\n", " "), ""]
        rows = top_level_fields() if cls is None else section_fields(prefix, cls)
        lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        lines += [f"| `{d.name}` | `{d.type}` | {_code(d.default)} | {_cell(d.doc)} |" for d in rows]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
