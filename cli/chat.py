"""`mlxd chat [MODEL]` (talk to a model in the terminal) and `mlxd run MODEL [PROMPT]` (one
answer, for scripts), over the daemon's Unix socket with OpenAI chat completions, streaming.

Input in `mlxd chat`: a line is a message; a line ending in `\\` continues on the next line;
a line starting with `\"\"\"` opens a block that ends at a line ending with `\"\"\"`. Commands:
/help, /clear (forget the conversation), /model NAME, /system TEXT (empty: none), /exit.
Ctrl-C stops the answer being written (what was shown stays in the conversation); at the
prompt, a second Ctrl-C in a row or Ctrl-D leaves.

The pure parts (reading one message from lines, commands, the conversation) are apart from
the terminal and socket glue at the bottom.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mlxd.cli import client

PROMPT = ">>> "
MORE = "... "
BLOCK = '"""'
HELP = """\
  /clear          forget the conversation (the system prompt stays)
  /model NAME     talk to another model from now on
  /system TEXT    set the system prompt (/system alone removes it)
  /help           this text
  /exit           leave (or Ctrl-D; Ctrl-C twice at the prompt)
Multi-line input: end a line with \\ to continue it, or write it between \"\"\" and \"\"\".
Ctrl-C while the model writes stops the answer."""
COMMANDS = ("help", "clear", "model", "system", "exit", "quit", "bye")


# ---------------------------------------------------------------- pure: input and conversation

def read_message(read_line: Callable[[str], str]) -> str:
    """One message from `read_line(prompt)` (which raises EOFError / KeyboardInterrupt as
    `input` does): a line, a `\\`-continued line, or a \"\"\" block."""
    line = read_line(PROMPT)
    if line.lstrip().startswith(BLOCK):
        first = line.lstrip()[len(BLOCK):]
        if first.rstrip().endswith(BLOCK):  # opened and closed on one line
            return first.rstrip()[:-len(BLOCK)]
        lines = [first] if first else []
        while True:
            more = read_line(MORE)
            if more.rstrip().endswith(BLOCK):
                lines.append(more.rstrip()[:-len(BLOCK)])
                return "\n".join(lines).rstrip("\n")
            lines.append(more)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_line(MORE)
    lines.append(line)
    return "\n".join(lines)


def parse_command(text: str) -> tuple[str, str] | None:
    """`(name, argument)` for a /command, ("unknown", text) for a / word that is none, None for
    a message."""
    stripped = text.strip()
    if not stripped.startswith("/") or "\n" in stripped:
        return None
    name, _, rest = stripped[1:].partition(" ")
    if name in COMMANDS:
        return name, rest.strip()
    return "unknown", stripped


@dataclass
class Conversation:
    """What the next request sends: the model (None: the daemon's default), the system
    prompt, and the turns so far."""
    model: str | None = None
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # temperature, max_tokens, seed

    def request(self, user_text: str) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        body: dict[str, Any] = {
            "messages": [*system, *self.turns, {"role": "user", "content": user_text}],
            **self.options}
        if self.model:
            body["model"] = self.model
        return body

    def answered(self, user_text: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user_text},
                       {"role": "assistant", "content": answer}]

    def clear(self) -> None:
        self.turns.clear()


# ---------------------------------------------------------------- `mlxd run`

def run_once(sock: Path, model: str, prompt: str, options: dict[str, Any],
             system: str | None = None, out: TextIO = sys.stdout) -> int:
    """The answer on `out` as it comes, then a newline; nothing else there. Errors on stderr:
    1 for an error answer, 3 for no daemon, 130 for Ctrl-C."""
    convo = Conversation(model=model, system=system, options=options)

    def write(content: str, _reasoning: str) -> None:
        if content:
            out.write(content)
            out.flush()

    try:
        client.stream_chat(sock, convo.request(prompt), write)
    except client.DaemonUnreachable as e:
        print(f"mlxd: {e}", file=sys.stderr)
        return 3
    except client.ApiError as e:
        print(f"mlxd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mlxd run ... | head`: the reader has all it wanted
        _silence_stdout()
        return 141
    try:
        out.write("\n")
        out.flush()
    except BrokenPipeError:
        _silence_stdout()
        return 141
    return 0


def _silence_stdout() -> None:
    """After a broken pipe, so that the interpreter's last flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


# ---------------------------------------------------------------- `mlxd chat`

class Chat:
    """The interactive loop: terminal in, streamed answers out."""

    def __init__(self, sock: Path, convo: Conversation, out: TextIO = sys.stdout,
                 read_line: Callable[[str], str] = input) -> None:
        self.sock = sock
        self.convo = convo
        self.out = out
        self.read_line = read_line
        self.dim = out.isatty()

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def run(self, model_name: str) -> int:
        _enable_line_editing()
        self.say(f"mlxd chat: {model_name} (via {self.sock}). /help for commands, Ctrl-D "
                 "to leave.")
        interrupted = False
        while True:
            try:
                text = read_message(self.read_line)
                interrupted = False
                command = parse_command(text)
                if not text.strip():
                    continue
                if command is None:
                    self.ask(text)  # a Ctrl-C in there stops the answer
                elif not self.command(*command):
                    return 0
            except EOFError:
                self.say("")
                return 0
            except KeyboardInterrupt:  # at the prompt (or between an answer and the prompt)
                if interrupted:
                    self.say("")
                    return 0
                interrupted = True
                self.say("\n(Ctrl-C again or Ctrl-D to leave)")

    def command(self, name: str, arg: str) -> bool:
        """Do a command; False to leave."""
        if name in ("exit", "quit", "bye"):
            return False
        if name == "help":
            self.say(HELP)
        elif name == "clear":
            self.convo.clear()
            self.say("(conversation cleared)")
        elif name == "model":
            if not arg:
                self.say(f"model: {self.convo.model or 'the default model'} (/model NAME to "
                         "change it)")
            else:
                self.convo.model = arg
                self.say(f"(model: {arg})")
        elif name == "system":
            self.convo.system = arg or None
            self.say(f"(system prompt: {arg})" if arg else "(no system prompt)")
        else:
            self.say(f"unknown command {arg.split()[0]}; /help lists them")
        return True

    def ask(self, text: str) -> None:
        shown: list[str] = []
        thinking = False

        def write(content: str, reasoning: str) -> None:
            nonlocal thinking
            if reasoning:
                if not thinking and self.dim:
                    self.out.write("\x1b[2m")
                thinking = True
                self.out.write(reasoning)
            if content:
                if thinking:
                    self.out.write("\x1b[0m\n" if self.dim else "\n")
                    thinking = False
                shown.append(content)
                self.out.write(content)
            self.out.flush()

        try:
            client.stream_chat(self.sock, self.convo.request(text), write)
        except KeyboardInterrupt:
            self._end_line(thinking)
            self.say("(stopped)")
            self.convo.answered(text, "".join(shown))
            return
        except (client.ApiError, client.DaemonUnreachable) as e:
            self._end_line(thinking)
            self.say(f"mlxd: {e}")
            if shown:
                self.convo.answered(text, "".join(shown))
            return
        self._end_line(thinking)
        self.convo.answered(text, "".join(shown))

    def _end_line(self, thinking: bool) -> None:
        self.out.write(("\x1b[0m" if thinking and self.dim else "") + "\n")
        self.out.flush()


def _enable_line_editing() -> None:
    """Arrow keys and history at the prompt, where the platform has readline."""
    try:
        import readline  # noqa: F401  importing it is what makes input() edit lines
    except ImportError:
        pass


def model_name(sock: Path, model: str | None) -> str:
    """What the chat talks to: `model`, or the model the daemon serves by default."""
    if model:
        return model
    status, body = client.call(sock, "GET", "/v1/models")
    if status == 200 and isinstance(body, dict) and body.get("data"):
        return str(body["data"][0]["id"])
    return "the default model"
