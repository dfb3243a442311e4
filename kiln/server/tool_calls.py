"""Tool calling on /v1/chat/completions: a request's ``tools`` and ``tool_choice`` become what
the chat template renders, the grammar that constrains the output (``required``, a named
function, ``strict`` schemas) and the OpenAI shapes of the calls parsed from the output
(``message.tool_calls``, streamed ``delta.tool_calls``).

The call syntax is the engine's chat-template family (kiln.tools): recorded in engine.json at
build, overridable with ``kiln serve --tool-parser``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.runtime.guided import GuidedSpec
from kiln.server.protocol import BadRequest, ChatCompletionRequest, NamedToolChoice
from kiln.server.schema_check import dotted, schema_problem
from kiln.tools import PARSERS, ToolDelta, ToolMode, ToolParser, get_parser


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools: the template's ``tools`` (OpenAI tool objects), the
    functions, the ``mode`` and whether several calls may come in one answer."""

    parser: type[ToolParser]
    tools: list[dict[str, Any]]
    mode: ToolMode
    parallel: bool
    name: str | None = None  # the function of mode "named"

    @property
    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]

    def guided(self) -> GuidedSpec | None:
        """The grammar over the output: calls forced (required, named) or, under auto, kept
        well-formed when a function asks for ``strict`` arguments; None: free text."""
        if self.mode == "auto" and not any(f.get("strict") for f in self.functions):
            return None
        tag = self.parser(self.functions).structural_tag(self.mode, self.parallel, self.name)
        return GuidedSpec("structural_tag", json.dumps(tag))

    def new_parser(self) -> ToolParser:
        return self.parser(self.functions)


def plan_tools(body: ChatCompletionRequest, parser_name: str | None) -> ToolPlan | None:
    """The request's ToolPlan, None when it uses no tools (none given, or tool_choice
    "none": the template then renders no tools and the output is not parsed)."""
    if not body.tools or body.tool_choice == "none":
        return None
    if parser_name is None:
        raise BadRequest(
            "this engine's chat template has no tool-call format kiln knows, so tool calls "
            "could not be read back; serve it with --tool-parser (one of "
            f"{', '.join(PARSERS)}) if its template renders tools, or send tool_choice "
            '"none"', "tools")
    guided, param = body.guided()
    if guided is not None:
        raise BadRequest(f"{param} cannot be combined with tools: tool calls have their own "
                         f'grammar; drop {param} or send tool_choice "none"', param)
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        mode, name = "named", choice.function.name
    else:
        mode, name = choice or "auto", None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    for i, tool in enumerate(tools):
        _check_parameters(i, tool["function"])
    parallel = body.parallel_tool_calls is not False
    return ToolPlan(get_parser(parser_name), tools, mode, parallel, name)


def _check_parameters(i: int, function: dict[str, Any]) -> None:
    """A 400 naming the tool and the path of the first mistake in its ``parameters``."""
    params = function.get("parameters")
    problem = None if params is None else schema_problem(params)
    if problem is not None:
        where, what = problem
        param = f"tools[{i}].function.parameters" + (f".{dotted(where)}" if where else "")
        raise BadRequest(f"tool {function['name']!r}: {param}: {what}; fix the tool's "
                         "parameters schema", param.replace(".[", "["))


async def compile_tools(plan: ToolPlan, param: str,
                        compile_guided: Callable[[Any], Any] | None) -> GuidedSpec | None:
    """``plan.guided()`` compiled (the compiler's cache warmed); when it cannot be, a 400
    naming the tool whose ``parameters`` the compiler refuses alone (the grammar of all the
    calls is an internal detail), else one naming ``param``."""
    guided = plan.guided()
    if guided is None:
        return None
    if compile_guided is None:
        raise BadRequest("tool calls need xgrammar (pip install xgrammar)", param)
    try:
        await asyncio.to_thread(compile_guided, guided)
        return guided
    except ValueError as e:
        whole = str(e).removeprefix(f"invalid {guided.kind}: ")
    for i, f in enumerate(plan.functions):
        if f.get("parameters") is None:
            continue
        try:
            await asyncio.to_thread(compile_guided, GuidedSpec("json_schema",
                                                               json.dumps(f["parameters"])))
        except ValueError as e:
            where = f"tools[{i}].function.parameters"
            raise BadRequest(f"tool {f['name']!r}: {where} cannot be compiled into a grammar "
                             f"({str(e).removeprefix('invalid json_schema: ')}); fix the "
                             "tool's parameters schema", where) from None
    raise BadRequest(f"the grammar for these tools' calls cannot be compiled ({whole}); "
                     "check the tools' parameters schemas", param)


def call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended (not truncated) with calls."""
    return "tool_calls" if called and reason == "stop" else reason


def message(parser: ToolParser, text: str) -> dict[str, Any]:
    """A finished answer as ``choices[i].message``."""
    parsed = parser.parse(text)
    out: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        out["tool_calls"] = [call_json(parser.new_call_id(), c.name, c.arguments)
                             for c in parsed.tool_calls]
    return out


class StreamedCalls:
    """One streamed choice: its output pieces in, ``delta`` dicts out."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._streamer = parser.streamer()
        self._ids: dict[int, str] = {}

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def feed(self, piece: str) -> dict[str, Any]:
        return self._delta(self._streamer.feed(piece) if piece else [])

    def finish(self) -> dict[str, Any]:
        return self._delta(self._streamer.finish())

    def _delta(self, events: list[ToolDelta]) -> dict[str, Any]:
        """``events`` as one delta: their content joined, their call pieces as
        ``tool_calls`` entries (a call's first entry carries its id, type and name)."""
        content = "".join(e.content for e in events)
        calls: list[dict[str, Any]] = []
        for e in events:
            if e.index is None:
                continue
            if e.index not in self._ids:
                self._ids[e.index] = self._parser.new_call_id()
                calls.append({"index": e.index, **call_json(self._ids[e.index], e.name or "",
                                                            e.arguments)})
            elif calls and calls[-1]["index"] == e.index:
                calls[-1]["function"]["arguments"] += e.arguments
            else:
                calls.append({"index": e.index, "function": {"arguments": e.arguments}})
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta
