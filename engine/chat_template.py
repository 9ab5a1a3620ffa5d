"""The tokenizer, with the chat template the config asks for.

`chat_template` (vLLM's `--chat-template`) replaces the template the tokenizer ships: a base model
has none (chat requests are then a 400), and a deployment may want another format. It is given
as a file holding a Jinja template or as the template itself, and set on the tokenizer once, so
the chat route, `/tokenize` and the offline `LLM.chat` all render the same one. A template that
does not parse stops the start, rather than failing every chat request later.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from pagedserve.configs.engine import ModelConfig


def load_tokenizer(path: Path | str, model_config: ModelConfig) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(
        path, trust_remote_code=model_config.trust_remote_code, local_files_only=True
    )
    if model_config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(model_config.chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """The template `value` names (a file) or is (text with Jinja tags). Raises ValueError."""
    path = Path(value).expanduser()
    if "{" not in value:  # a template always has a tag; a path has none (vLLM's rule)
        try:
            template = path.read_text()
        except OSError as exc:
            raise ValueError(f"chat_template: cannot read {value!r} ({exc.strerror})") from exc
    else:
        template = value
    try:  # as transformers compiles it (its extensions: loop controls, {% generation %})
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse: {exc} (line {exc.lineno})") from exc
    return template
