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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IMAGE_TAG = "<image>"
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
TOOL_ROLES = ("observation", "function_call", "function", "tool", "ipython")


@dataclass(frozen=True)
class Tags:
    """How a source names a message's keys and roles (LLaMA-Factory's dataset_info.json `tags`); by default
    `role`/`content` or `from`/`value`, and the role names in ROLES."""

    role_tag: str | None = None
    content_tag: str | None = None
    roles: dict[str, str] = field(default_factory=lambda: dict(ROLES))


@dataclass(frozen=True)
class Turn:
    role: str  # system | user | assistant
    text: str  # image tags and parts removed
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
    role = tags.roles.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        hint = (" (tool calls are not read: drop such turns or records)" if raw_role in TOOL_ROLES else "")
        raise ValueError(f"{what} has role {raw_role!r}; known roles: {', '.join(sorted(tags.roles))}{hint}")
    return Turn(role, *text_of(message[content_key], f"{what}.{content_key}"))


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
    return Conversation(rest[last_user].text, system, history, answer, sum(t.images for t in turns))


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
