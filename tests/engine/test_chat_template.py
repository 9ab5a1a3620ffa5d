"""`chat_template` (vLLM's --chat-template): a file or the template itself replaces the tokenizer's,
everywhere the engine renders chats; a template that cannot be read or parsed stops the start."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.engine.chat_template import read_chat_template

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


def test_a_template_is_read_from_its_file_or_taken_as_written(tmp_path: Path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("/no/such/template.jinja", "cannot read"),
        ("{% for m in messages %}never closed", "does not parse"),
        ("{{ messages[0] }", "does not parse"),
    ],
)
def test_a_template_that_cannot_be_read_or_parsed_is_an_error(value, message):
    with pytest.raises(ValueError, match=message):
        read_chat_template(value)


def test_a_template_with_transformers_own_tags_is_accepted():
    # {% generation %} marks the assistant's tokens for training masks: transformers' extension.
    template = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    assert read_chat_template(template + "{% endfor %}").startswith("{% for")
