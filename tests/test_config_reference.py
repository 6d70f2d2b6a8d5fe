"""The generated configuration reference: every schema field documented, and shown."""

import dataclasses

from ragen_jax.config import reference as ref
from ragen_jax.config.schema import RunConfig


@dataclasses.dataclass
class _Example:
    plain: int = 1  # a plain field
    wrapped: tuple = (  # not this line's comment
        "a", "b")  # the statement's last line carries it
    bare: str = ""


def test_every_schema_field_has_a_doc_comment():
    missing = ref.missing_docs()
    assert not missing, ("config fields without a trailing doc comment (the configuration "
                         f"reference would show them blank): {missing}")


def test_reference_shows_every_field_with_its_default():
    page = ref.reference_markdown()
    fields = ref.all_fields()
    assert len(fields) > 100
    for d in fields:
        assert f"| `{d.name}` | `{d.type}` |" in page
    assert "| `rollout.max_turn` | `int` | `5` |" in page
    assert "`config.env.mix[i]`" in page
    assert "| `rollout.sampling.temperature` | `float` | `1.0` |" in page  # a nested section's
    assert "`config.warmstart.turns`" in page


def test_sections_cover_the_run_config():
    names = {prefix for prefix, _ in ref.sections()}
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(f.type) or f.name not in ("seed", "preset"):
            assert f.name in names


def test_field_comments_are_read_from_the_source():
    assert ref.field_comments(_Example) == {
        "plain": "a plain field", "wrapped": "the statement's last line carries it", "bare": ""}


def test_table_cells_escape_pipes():
    assert ref._cell("a | b") == "a \\| b"
    assert ref._code("x|y") == "`'x\\|y'`"
