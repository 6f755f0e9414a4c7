"""docs/wire.md lists every side-channel message and every event with its tag: the classes are walked, not written
down here, so a new message or event that the page does not record fails this test."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import msgspec
import pytest

import kvlifecycle
from kvlifecycle import events as ev

WIRE_DOC = Path(__file__).resolve().parents[1] / "docs" / "wire.md"
NOT_CORE = ("kvlifecycle.cli", "kvlifecycle.tools", "kvlifecycle.__main__", "kvlifecycle.transports",
            "kvlifecycle.adapters", "kvlifecycle.sim")  # the simulator's messages are its own, never on a wire


def event_tags() -> dict[str, str]:
    """Every concrete event class (a subclass of ``Event``, at any depth), by name, with its ``k`` tag."""
    found: dict[str, str] = {}
    todo = list(ev.Event.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        found[cls.__name__] = str(cls.__struct_config__.tag)
    return found


def side_channel_messages() -> dict[str, str]:
    """Every tagged msgspec struct of the core with the default tag field (``type``): the side channel's bodies,
    by name, with their tag."""
    found: dict[str, str] = {}
    root = [str(Path(kvlifecycle.__file__).parent)]
    for info in pkgutil.walk_packages(root, prefix="kvlifecycle."):
        if any(info.name == p or info.name.startswith(p + ".") for p in NOT_CORE):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == info.name
                    and value.__struct_config__.tag is not None and value.__struct_config__.tag_field == "type"):
                found[value.__name__] = str(value.__struct_config__.tag)
    return found


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown page."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match is not None, f"docs/wire.md has no section {title!r}"
    return match.group(1)


def table_rows(body: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in body.splitlines() if line.startswith("| `")]


def unlisted_events(text: str, events: dict[str, str]) -> dict[str, str]:
    listed = {(row[1], row[0]) for row in table_rows(section(text, "Every event tag"))}
    return {name: tag for name, tag in events.items() if (f"`{name}`", f"`{tag}`") not in listed}


def unlisted_messages(text: str, messages: dict[str, str]) -> dict[str, str]:
    listed = {row[0] for row in table_rows(section(text, "Every side-channel message"))}
    return {name: tag for name, tag in messages.items() if f"`{tag}`" not in listed}


def test_the_walk_finds_the_known_classes() -> None:
    events, messages = event_tags(), side_channel_messages()
    assert events["TgtLoadDeclined"] == "tw" and events["SrcGranted"] == "sg" and len(events) >= 29
    assert {"GetMeta", "MetaReply", "GrantReply", "Heartbeat", "StreamHeartbeat", "ErrorReply", "Ack"} <= set(messages)
    assert all(tag == name for name, tag in messages.items())  # tag=True: the class name is the tag
    assert not set(events) & set(messages)


def test_every_event_is_listed_with_its_tag() -> None:
    assert unlisted_events(WIRE_DOC.read_text(), event_tags()) == {}


def test_every_side_channel_message_is_listed() -> None:
    assert unlisted_messages(WIRE_DOC.read_text(), side_channel_messages()) == {}


@pytest.mark.mutants
def test_a_page_missing_an_event_or_a_message_or_naming_a_wrong_tag_fails() -> None:
    """The page with TgtLoadDeclined's row dropped, SrcGranted given another tag, and Heartbeat's row dropped: each
    is reported."""
    text = WIRE_DOC.read_text()
    broken = re.sub(r"^\| `tw` \| `TgtLoadDeclined` .*\n", "", text, flags=re.M)
    broken = broken.replace("| `sg` | `SrcGranted` |", "| `sq` | `SrcGranted` |")
    broken = re.sub(r"^\| `Heartbeat` \|.*\n", "", broken, flags=re.M)
    assert broken != text
    assert unlisted_events(broken, event_tags()) == {"TgtLoadDeclined": "tw", "SrcGranted": "sg"}
    assert unlisted_messages(broken, side_channel_messages()) == {"Heartbeat": "Heartbeat"}
