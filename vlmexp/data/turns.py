"""Conversations as the field publishes them, read into one shape: an optional system message, earlier
turns, the last user turn, and the answer after it.

Read unchanged (after a source's `columns`):
- TRL's conversational datasets (trl docs/source/dataset_formats.md, "Vision datasets"): messages
  `{"role", "content"}` whose content is a string or a list of typed parts `{"type": "image"}` /
  `{"type": "text", "text"}` (HuggingFaceH4/llava-instruct-mix-vsft adds an `index`); language modeling
  `messages`, prompt-completion `prompt` / `completion`, prompt-only `prompt`, preference `prompt` / `chosen`
  / `rejected` (chosen and rejected a string or a list of assistant messages, trl-lib/rlaif-v).
- LLaMA-Factory's sharegpt (data/README.md): `conversations` or `messages` of `{"from", "value"}` (human /
  gpt / system) or `{"role", "content"}`, `<image>` tags matched to `images`, a preference record's `chosen`
  / `rejected` as one message each; dataset_info.json `tags` rename the keys and roles.
- VLM-R1's conversations (`from` / `value`, human / gpt); ms-swift's standard format
  (docs/source_en/Customization/Custom-dataset.md: `messages` with `<image>` tags, `images`,
  `rejected_response` for DPO).

Images are placed where TRL places them when content is text: every image at the start of the first user
turn (trl/data_utils.py `prepare_multimodal_messages`; TRL's own llava-instruct-mix conversion also drops the
`<image>` tags, examples/datasets/llava_instruct_mix.py). So `<image>` tags and `{"type": "image"}` parts are
counted, must match the record's images when there are any, and are removed from the text.

Tool use after the last user turn (the answer took tool calls, e.g. a zoom whose crop comes back as an image):
- TRL's layout (trl docs/source/dataset_formats.md, "Tool calling"): an assistant message with `tool_calls`
  `[{"type": "function", "function": {"name", "arguments"}}]`, then `{"role": "tool", "content": ...}`;
- ms-swift's agent layout (docs/source_en/Customization/Custom-dataset.md, "Agent format"): `{"role":
  "tool_call", "content": "{\"name\": ..., \"arguments\": ...}"}` then `{"role": "tool_response", ...}`;
- LLaMA-Factory's `function_call` / `observation` roles read as ms-swift's.
Each call is rendered once, here, as the model writes it (`render_tool_call`); a tool turn keeps its text and
counts its images, which follow the question's images in the record's `images`, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IMAGE_TAG = "<image>"
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
# tool roles -> call (the assistant calls a tool) or tool (the tool's answer)
TOOL_ROLES = {"tool_call": "call", "function_call": "call", "tool": "tool", "tool_response": "tool",
              "observation": "tool", "function": "tool", "ipython": "tool"}


@dataclass(frozen=True)
class Tags:
    """How a source names a message's keys and roles (LLaMA-Factory's dataset_info.json `tags`); by default
    `role`/`content` or `from`/`value`, and the role names in ROLES."""

    role_tag: str | None = None
    content_tag: str | None = None
    roles: dict[str, str] = field(default_factory=lambda: dict(ROLES))


@dataclass(frozen=True)
class Turn:
    role: str  # system | user | assistant | call (an assistant's tool call) | tool (a tool's answer)
    text: str  # image tags and parts removed; an assistant's calls rendered after its text
    images: int  # `<image>` tags or image parts in it


@dataclass(frozen=True)
class Conversation:
    """What a stage takes from a conversation: the last user turn, what came before it, the answer after
    it."""

    problem: str
    system: str | None
    history: list[dict[str, str]]  # earlier turns, {role, content}, user and assistant alternating
    answer: str | None  # the assistant turn after the last user turn, when there is one
    image_tags: int  # `<image>` tags and image parts in all turns
    # the assistant's and tools' turns between the last user turn and the answer, when it took tool calls:
    # {role: assistant, content: text with its calls rendered} and {role: tool, content: text, images: n}
    tool_turns: list[dict] = field(default_factory=list)


def read_turns(value: Any, what: str, tags: Tags = Tags()) -> list[Turn]:
    """The turns of a list of messages, or ValueError naming the message, the key and the fix."""
    if isinstance(value, str):
        return [Turn("user", *text_of(value, what))]
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {what!r} must be a non-empty list of messages, got {_kind(value)}")
    return [read_turn(m, f"{what}[{i}]", tags) for i, m in enumerate(value)]


def read_turn(message: Any, what: str, tags: Tags = Tags()) -> Turn:
    if not isinstance(message, dict):
        raise ValueError(f"{what} must be a message object, got {_kind(message)}")  # noqa: TRY004 - as above
    role_key = tags.role_tag or ("role" if "role" in message else "from")
    content_key = tags.content_tag or ("content" if "content" in message else "value")
    if role_key not in message or content_key not in message:
        raise ValueError(f"{what} needs {role_key!r} and {content_key!r} (a message is {{role, content}} or "
                         f"{{from, value}}), it has {sorted(message)}")
    raw_role = message[role_key]
    role = (tags.roles.get(raw_role) or TOOL_ROLES.get(raw_role)) if isinstance(raw_role, str) else None
    if role is None:
        raise ValueError(f"{what} has role {raw_role!r}; known roles: "
                         f"{', '.join(sorted({*tags.roles, *TOOL_ROLES}))}")
    if role == "call":  # ms-swift: the content is the call's JSON
        return Turn("call", render_tool_call(_call_of(message[content_key], f"{what}.{content_key}")), 0)
    content = message[content_key]
    text, images = ("", 0) if content is None and message.get("tool_calls") else text_of(
        content, f"{what}.{content_key}")
    if message.get("tool_calls") is not None:  # TRL: the assistant's calls beside its content
        if role != "assistant":
            raise ValueError(f"{what} has tool_calls but role {raw_role!r}; only an assistant calls tools")
        calls = message["tool_calls"]
        if not isinstance(calls, list) or not calls:
            raise ValueError(f"{what}.tool_calls must be a non-empty list of {{type: function, function: "
                             f"{{name, arguments}}}}, got {_kind(calls)}")
        rendered = [render_tool_call(_call_of(c.get("function") if isinstance(c, dict) else c,
                                              f"{what}.tool_calls[{i}].function"))
                    for i, c in enumerate(calls)]
        return Turn("call", "\n".join(t for t in (text, *rendered) if t), images)
    return Turn(role, text, images)


def render_tool_call(call: dict[str, Any]) -> str:
    """A tool call as the model writes it: Qwen's
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, byte for byte as the chat template with
    tools renders an assistant's `tool_calls` (vlmexp/families/qwen2_5_vl_tools.jinja, Qwen3-VL's own) and
    TRL's Qwen response parser reads them back, so SFT teaches the form GRPO's rollouts parse."""
    import json

    return f"<tool_call>\n{json.dumps({'name': call['name'], 'arguments': call['arguments']})}\n</tool_call>"


def _call_of(value: Any, what: str) -> dict[str, Any]:
    """{name, arguments (an object)} of a tool call written as an object or its JSON text; ValueError naming
    `what` otherwise."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not a tool call's JSON ({e.msg}); write "
                             '{"name": ..., "arguments": {...}}') from None
    arguments = value.get("arguments") if isinstance(value, dict) else None
    if isinstance(arguments, str):  # OpenAI's layout: the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}.arguments is not JSON ({e.msg}); write an object of the call's "
                             "arguments") from None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(arguments, dict)):
        raise ValueError(f"{what} must be a tool call {{name: str, arguments: object}}, got {_kind(value)}")
    return {"name": value["name"], "arguments": arguments}


def answer_text(value: Any, what: str, tags: Tags = Tags()) -> str:
    """A chosen / rejected / completion answer: a string, one assistant message, or a list of messages
    ending in an assistant one (TRL's conversational layout)."""
    if isinstance(value, str):
        text = value
    else:
        turns = read_turns(value if isinstance(value, list) else [value], what, tags)
        if turns[-1].role != "assistant" or turns[-1].images:
            raise ValueError(f"field {what!r} must end in an assistant message of text, got a "
                             f"{turns[-1].role} one")
        text = turns[-1].text
    if not text.strip():
        raise ValueError(f"field {what!r} is an empty answer; give each record a non-empty answer")
    return text


def conversation(turns: list[Turn], what: str) -> Conversation:
    """Split turns into system, history, last user turn and the answer after it; ValueError names the turn
    order problem (optional system first, then user and assistant alternating, starting with user)."""
    system = turns[0].text if turns and turns[0].role == "system" else None
    rest = turns[1:] if system is not None else turns
    rest, tool_turns = _tool_turns(rest, what, offset=len(turns) - len(rest))
    for i, turn in enumerate(rest):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn.role != expected:
            raise ValueError(f"{what}: turn {i + (system is not None)} is {turn.role!r} where {expected!r} "
                             f"belongs (a system message may come first, then user and assistant turns "
                             f"alternate, starting with user); fix the record's turns")
    if not rest:
        raise ValueError(f"{what} holds no user turn; give the record a question")
    answer = rest[-1].text if rest[-1].role == "assistant" else None
    last_user = len(rest) - (2 if answer is not None else 1)
    if answer is not None and not answer.strip():
        raise ValueError(f"{what}: the last assistant turn is empty; give it the answer or drop it")
    history = [{"role": t.role, "content": t.text} for t in rest[:last_user]]
    return Conversation(rest[last_user].text, system, history, answer, sum(t.images for t in turns),
                        tool_turns)


def _tool_turns(turns: list[Turn], what: str, offset: int) -> tuple[list[Turn], list[dict]]:
    """(the turns up to the last user turn plus the answer, the tool use between them). Tool use: calls (an
    assistant turn's calls, or ms-swift's `tool_call` turns, merged with the assistant text before them) each
    followed by the tools' answers; it must end in an answer without calls. ValueError names the turn."""
    used = [i for i, t in enumerate(turns) if t.role in ("call", "tool")]
    if not used:
        return turns, []
    last_user = max((i for i, t in enumerate(turns) if t.role == "user"), default=-1)
    if used[0] < last_user:
        raise ValueError(f"{what}: turn {used[0] + offset} is a tool turn before the last user turn; tool "
                         "use is read only between the question and its answer")
    steps: list[dict] = []
    for i, turn in enumerate(turns[last_user + 1:-1], start=last_user + 1 + offset):
        before = steps[-1] if steps else None
        if turn.role == "tool":
            if before is None or (before["role"] == "assistant" and not before.get("calls")):
                raise ValueError(f"{what}: turn {i} is a tool's answer that follows no tool call; each tool "
                                 "turn answers the call before it")
            steps.append({"role": "tool", "content": turn.text, "images": turn.images})
        elif turn.role in ("call", "assistant"):
            if turn.images:
                raise ValueError(f"{what}: turn {i} is an assistant turn with an image; images come with the "
                                 "user's and the tools' turns")
            if before is not None and before["role"] == "assistant":  # ms-swift: text, then its tool_call
                before["content"] = "\n".join(t for t in (before["content"], turn.text) if t)
                before["calls"] = before["calls"] or turn.role == "call"
            else:
                steps.append({"role": "assistant", "content": turn.text, "calls": turn.role == "call"})
        else:
            raise ValueError(f"{what}: turn {i} is {turn.role!r} inside tool use; after the last user turn "
                             "come the assistant's calls, the tools' answers and the final answer")
    final = turns[-1]
    if final.role != "assistant" or (steps and steps[-1]["role"] == "assistant"):
        raise ValueError(f"{what}: tool use must end in the assistant's answer after the last tool turn, got "
                         f"a {final.role!r} turn last; add the answer or drop the record")
    for step in steps:
        if step["role"] == "assistant":
            if not step.pop("calls"):
                raise ValueError(f"{what}: an assistant turn inside tool use calls no tool; merge it with "
                                 "the next one or drop it")
    return [*turns[:last_user + 1], final], steps


def text_of(content: Any, what: str) -> tuple[str, int]:
    """(text without image tags or parts, how many images it names) of a message's content: a string or a
    list of typed parts; ValueError naming `what` otherwise."""
    if isinstance(content, str):
        return content.replace(IMAGE_TAG, "").strip(), content.count(IMAGE_TAG)
    if not isinstance(content, list):
        raise ValueError(  # noqa: TRY004 - the sampler reports a ValueError as the record's problem
            f"{what} must be text or a list of parts {{type: text | image}}, got {_kind(content)}")
    texts, images = [], 0
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            images += 1
        elif kind == "text" and isinstance(part.get("text"), str):
            text, tags = text_of(part["text"], what)
            texts.append(text)
            images += tags
        else:
            raise ValueError(f"{what}[{j}] is not a part {{type: text, text}} or {{type: image}} "
                             f"(got {_kind(part)}); other media are not read")
    return "\n".join(t for t in texts if t), images


def _kind(value: Any) -> str:
    from vlmexp.errors import short

    return f"{type(value).__name__} {short(value, 80)}"
