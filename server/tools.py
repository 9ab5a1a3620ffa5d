"""Tool calling for chat completions: check `tools` / `tool_choice`, put the tools into the prompt
(the chat template's `tools` argument, or a Hermes-style system block when the template ignores
them), force "required" and named calls through the structured-output layer, and say which parser
reads the calls back. Everything here runs before the request is queued."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.configs import ServerConfig, StructuredOutputs
from pagedserve.server.errors import invalid_request
from pagedserve.server.json_input import load_json
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.server.tool_parsers import (
    PARSERS,
    CallDelta,
    ForcedCallsParser,
    ToolCallParser,
)
from pagedserve.server.tool_protocol import (
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)

JSON_SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
NO_ARGUMENTS = {"type": "object", "properties": {}}
# The fallback block (Hermes 2 Pro's wording), for templates that do not render `tools`.
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools:\n<tools>\n{tools}\n</tools>\nFor each function call return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def openai_call_id() -> str:
    """OpenAI's shape of a call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """The only ids Mistral's chat templates accept back: 9 alphanumeric characters."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses its tools. mode: none | auto | required | named."""

    mode: str
    tools: list[dict[str, Any]]  # OpenAI's tool objects, for the template or the fallback block
    parser_name: str | None  # auto: the server's --tool-call-parser
    named: str | None = None
    constraint: StructuredOutputs | None = None
    call_id: Callable[[], str] = openai_call_id  # makes each call's id (mistral_call_id)

    @property
    def shows_special_tokens(self) -> bool:
        """Whether the reply's text must keep special tokens: the parser reads calls after one
        (Mistral's `[TOOL_CALLS]`)."""
        return self.mode == "auto" and self.parser_name == "mistral"

    def new_parser(self) -> ToolCallParser | None:
        if self.mode in ("required", "named"):
            return ForcedCallsParser(self.named)
        if self.mode == "auto" and self.parser_name is not None:
            return PARSERS[self.parser_name](self.tools)
        return None


def plan_tools(body: ChatCompletionRequest, server: ServerConfig) -> ToolPlan | None:
    """Raises a 400 naming the parameter for a tool_choice without tools, an unknown named tool,
    a parameters schema that is not a JSON Schema object, or auto without the server's parser."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid_request("tool_choice needs tools", "tool_choice")
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    schemas = {tool.function.name: _parameters(tool.function.parameters) for tool in body.tools}
    if choice == "none":
        return ToolPlan("none", [], None)
    # Mistral's chat templates accept only its own call ids, for forced calls too (as vLLM).
    call_id = mistral_call_id if server.tool_call_parser == "mistral" else openai_call_id
    if choice is None or choice == "auto":
        if not server.enable_auto_tool_choice:
            raise invalid_request(
                'tool_choice "auto" needs the server\'s --enable-auto-tool-choice and '
                '--tool-call-parser; use "required" or a named tool',
                "tool_choice",
            )
        return ToolPlan("auto", tools, server.tool_call_parser, call_id=call_id)
    if choice == "required":
        # Each tool's parameters sit in $defs, their own "#..." references re-pointed there:
        # resolved from the array's root, `#/$defs/Loc` or a recursive `#` would miss them.
        calls = {
            "$defs": {
                f"tool_{i}": _rooted_at(schema, f"#/$defs/tool_{i}")
                for i, schema in enumerate(schemas.values())
            },
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    _call_schema(name, {"$ref": f"#/$defs/tool_{i}"})
                    for i, name in enumerate(schemas)
                ]
            },
        }
        if not body.parallel_tool_calls:
            calls["maxItems"] = 1
        constraint = StructuredOutputs("json", json.dumps(calls), "tools")
        return ToolPlan("required", tools, None, constraint=constraint, call_id=call_id)
    name = choice.function.name
    if name not in schemas:
        raise invalid_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    constraint = StructuredOutputs("json", json.dumps(schemas[name]), "tools")
    return ToolPlan("named", tools, None, named=name, constraint=constraint, call_id=call_id)


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    if schema is None:
        return NO_ARGUMENTS
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise invalid_request("a tool's parameters must be a JSON Schema of an object", "tools")
    # A call's arguments are an object: forced, a schema of ["object", "number"] (or of no type)
    # would let the model write a number, which no parser reads as a call.
    return {**schema, "type": "object"}


# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = ("enum", "const", "default", "examples")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rooted_at(schema: Any, pointer: str) -> Any:
    """`schema` with each local reference ("#", "#/$defs/X", ...) re-pointed from the schema's
    root to `pointer`, where the schema now sits inside a larger one."""
    if isinstance(schema, list):
        return [_rooted_at(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rooted = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rooted[key] = pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            rooted[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas (any names)
            rooted[key] = {name: _rooted_at(sub, pointer) for name, sub in value.items()}
        else:
            rooted[key] = _rooted_at(value, pointer)
    return rooted


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"enum": [name]}, "arguments": parameters},
        "required": ["name", "arguments"],
    }


def template_messages(
    messages: list[ChatMessage], tools: list[dict[str, Any]], renders_tools: bool
) -> list[dict[str, Any]]:
    """Messages as the template expects them. A template that renders tools gets assistant
    calls with their arguments decoded and `tool_call_id`s; otherwise the calls and results are
    written in the fallback's Hermes tags and the tools go into a system block."""
    conversation = []
    for message in messages:
        entry: dict[str, Any] = message.to_template_message()
        calls = message.tool_calls or []
        if renders_tools:
            if calls:
                entry["tool_calls"] = [_template_call(call.id, call.function) for call in calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
        elif calls:
            blocks = [
                f"<tool_call>\n{json.dumps(_template_call(c.id, c.function)['function'])}\n"
                "</tool_call>"
                for c in calls
            ]
            entry["content"] = "\n".join([entry["content"], *blocks]).strip()
        elif message.role == "tool":
            entry["content"] = f"<tool_response>\n{entry['content']}\n</tool_response>"
        conversation.append(entry)
    if tools and not renders_tools:
        block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if conversation and conversation[0]["role"] == "system":
            conversation[0] = {
                **conversation[0],
                "content": conversation[0]["content"] + "\n\n" + block,
            }
        else:
            conversation.insert(0, {"role": "system", "content": block})
    return conversation


def _template_call(call_id: str, function: FunctionCall) -> dict[str, Any]:
    try:
        arguments: Any = load_json(function.arguments)
    except ValueError:
        arguments = function.arguments  # left as sent
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function.name, "arguments": arguments},
    }


class OpenAICalls:
    """One choice's calls in OpenAI's streamed shape: a call's first piece gets its id, type and
    name (with empty arguments), its arguments follow as they come. With `max_calls` 1
    (parallel_tool_calls false under auto: the grammar enforces it for forced calls) the calls
    after the first are dropped."""

    def __init__(
        self, max_calls: int | None = None, call_id: Callable[[], str] | None = None
    ) -> None:
        self.max_calls = max_calls
        self.num_calls = 0
        self.call_id = call_id or openai_call_id

    def deltas(self, pieces: list[CallDelta]) -> list[ToolCallDelta]:
        out = []
        for piece in pieces:
            if self.max_calls is not None and piece.index >= self.max_calls:
                continue
            if piece.name is not None:
                self.num_calls += 1
                out.append(
                    ToolCallDelta(
                        index=piece.index,
                        id=self.call_id(),
                        type="function",
                        function=FunctionCallDelta(name=piece.name, arguments=""),
                    )
                )
            if piece.arguments:
                out.append(
                    ToolCallDelta(
                        index=piece.index, function=FunctionCallDelta(arguments=piece.arguments)
                    )
                )
        return out


def assemble_tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The whole calls that streamed deltas make up (what a client joins them into)."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.id is not None:
            name = delta.function.name or ""
            calls[delta.index] = ToolCall(
                id=delta.id, function=FunctionCall(name=name, arguments="")
            )
        calls[delta.index].function.arguments += delta.function.arguments or ""
    return [calls[index] for index in sorted(calls)]
