"""Coding-agent sessions replayed through the official SDKs, side by side in one run with
`mlx_lm.server` on the same trace (issue 33, item 1).

Configurations (`--configs`, each a server and a route):

- `mlxd-openai`: the openai SDK (chat completions, tools, streaming) against `mlxd serve --isolate`;
- `mlx_lm-openai`: the same SDK and trace against `mlx_lm.server` (it has only the OpenAI route,
  so the side-by-side comparison is this pair);
- `mlxd-anthropic`: the anthropic SDK (`/v1/messages`, tools, streaming) against the same mlxd,
  on a trace of its own (the same shape, other text: the OpenAI pair's trace would be a cache hit).

The trace is synthetic but shaped like a coding agent's: a system prompt with instructions and
twelve tool definitions (`--system-tokens`, 8,000 at scale 1: 6-10k; scaled down, a tool per
600 tokens, at least 3); a first user message (the task); then each turn appends the model's
answer as the server returned it, a tool call (the OpenAI `tool_calls` / Anthropic `tool_use`
structure: the model's own calls as returned when it made any that parse, else the trace's
Read, Bash, Grep, Edit... with realistic arguments) and the trace's tool result (a file
listing, test output, grep hits: 0.5-4k tokens at scale 1, log-uniform), until the prompt
reaches `--target-tokens` (32k on the CPU, 64k on the GPU at scale 1) or for `--turns`
requests. `--sessions N` run at once, sharing the system prompt and tools
(subagents), each with its own task and tool results. Between turns a short side request asks
for a title ("Summarize this conversation in 5 words", a small prompt of its own, as Claude Code
sends; `--side full`: the whole conversation plus that question; `--side none`: off).
`--volatile-line` puts a line that changes on every request at the top of the system prompt, as
Claude Code's `x-anthropic-billing-header: cc_version=...; cch=<random>` line (on the Anthropic
route as a system block of its own, the rest of the system prompt a block with `cache_control`).
`--scale` multiplies every token size (e.g. 0.1 on the CPU). Answers: `--max-tokens` (48),
temperature 0.

Per turn: prompt tokens, cached tokens (OpenAI `usage.prompt_tokens_details.cached_tokens`;
Anthropic `cache_read_input_tokens`; `mlx_lm.server` reports `cached_tokens` too), time to the
first content (text or tool call) on the client, decode rate (completion tokens after the first
over the time from the first content to the last delta). Per session: the share of prompt tokens
served from cache (all turns, and after the first turn), wall time (side requests included).
Whether each turn reused the previous turn's whole prompt (`cached >= previous prompt`) and its
answer as re-rendered (`cached >= previous prompt + previous answer - 1`) is counted.

In-process reference (benchmarks/agent_inprocess.py): after the servers have stopped, a child
process (mlx-lm alone, the same model directory, nothing of mlxd) replays each session of the
`mlxd-openai` runs (every repetition's; `--inprocess-reps N`: the first N; `--no-inprocess`:
none): per turn, from the prompt and cached tokens mlxd reported, one KV cache per session
trimmed back or prefilled (untimed) to the turn's cached tokens, then `generate_step` over the
uncached tokens (random ids; prefill step 2048, mlx-lm's, or `--inprocess-prefill-step`):
`inproc_ttft_s` (the uncached prefill up to the first token) and `inproc_decode_tps` (the turn's
completion length at its context), written into mlxd's turns. It measures each session alone,
where the servers ran `--sessions` at once. Its cost: about one prefill of each session's final
context (plus what mlxd's caches missed) and its answers' decoding, one session at a time.

Repetitions (`--reps`, 3) interleave the configurations in a rotating order; each repetition is
fresh traces (their own seeds: no repetition is served from another's cache; the OpenAI pair
shares one). Medians with the min-max spread over repetitions; mlxd over mlx_lm.server ratios
are paired within a repetition. Each server first runs a warm-up session of two turns. Prints
markdown tables (the medians; each repetition's figures against the reference; per turn) and a
goals block, and writes benchmarks/results/agent_session-<model>-<machine>[-<tag>].json (also
after each repetition but the last, marked `partial`, and before the reference: a run cut short
keeps what it measured); `--from-json FILE` computes a file's summary, goals and tables again
(`--measure-inprocess`: measures its reference first, on the machine that has its model).

Goals (issue 33; each figure a repetition's, met when every repetition meets it; turns after
each session's first):
(a) the share of prompt tokens served from cache (beside its ceiling, all but each turn's new
    tokens); proposed bound: every turn reuses its previous prompt whole;
(b) mlxd's first token over the reference's, per turn: median and worst turn, worst <= 1.3;
(c) a session's slowest first token over its median one, the worst session: <= 2.0 (mlxd's
    routes; mlx_lm.server's beside it);
(d) decode rate at long context (turns whose prompt is at least half the session's largest)
    over the reference's for the same turns, median: >= 0.95 (mlx_lm.server's beside it, its
    turns paired with mlxd's on the same trace where the prompts are within 5%);
(e) session wall time mlxd / mlx_lm.server, paired within repetitions; proposed bound: <= 1.0.

The servers run the mlxd of `--tree` (default: the checkout holding this file) through a package
view on PYTHONPATH (its commit is recorded), not whatever the editable install points at.

    python benchmarks/agent_session.py --model tiny --scale 0.5 --sessions 2       # CPU: 18 min
    python benchmarks/agent_session.py --model default --scale 0.04 --turns 4 \
        --warm-up-scale 0.02                  # CPU, SmolLM2 (prefills ~5-10 tok/s here): 31 min
    python benchmarks/agent_session.py --shape 1b --sessions 2 --turns 32 --machine h200 --tag 2s \
        --mlxd-args "--engine-memory 60"   # both servers share one GPU: mlxd's default takes a
                                            # quarter of it for its RAM tier; mlx_lm.server
                                            # ran out of memory past ~35k tokens even alone
        # (scale 1: 32 turns reach 50-70k tokens; --target-tokens is not used with --turns)

Models: `--model tiny` (random float32 Llama, hidden 64, 2 layers, context 65,536), `--model
default` (mlxd's default SmolLM2-135M, converted from its GGUF into mlxd's cache directory, the
same MLX directory for both servers), a model directory, or `--shape 1b` / `--shape 8b` (random
bfloat16 Llamas of ~1B / ~7B parameters, context 131,072). Random models get a Qwen2.5-style
ChatML template that renders tools, tool calls and tool results (`TOOL_TEMPLATE`); so does the
default model (`--template tools`, the default: a directory of links to its files with that
template; SmolLM2's own template, `--template model`, drops the tool definitions and calls, so
the prompt would hold none of the tool list).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from agent_inprocess import prefill_step_of, run_reference  # noqa: E402
from agent_report import goals, per_turn, rep_figures, sessions_of, summarize, tables  # noqa: E402
from cache_families import Logged, cache_figures, stats  # noqa: E402
from throughput import free_port  # noqa: E402

CONFIGS = ["mlxd-openai", "mlx_lm-openai", "mlxd-anthropic"]
STARTED: list[Logged] = []  # every server started, stopped however the run ends

# shape -> (hidden, layers, heads, kv_heads, intermediate, vocab, context, dtype)
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 512, 65536, "float32"),
    "1b": (2048, 16, 32, 8, 8192, 32000, 131072, "bfloat16"),  # throughput.py's 1b
    "8b": (4096, 32, 32, 8, 14336, 32000, 131072, "bfloat16"),  # Llama-3-8B's blocks
}

# Qwen2.5's chat template (tools in the system turn, <tool_call> JSON in assistant turns,
# <tool_response> in a user turn), the shape of most open coding models' templates.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


# ---------------------------------------------------------------- the tree and the models

def tree_view(tree: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes `import mlxd` (all its subpackages, `mlxd.cli`
    included: constrained.tree_view leaves it to the editable install) load `tree`."""
    view = Path(tempfile.mkdtemp(prefix="mlxd-tree-"))
    pkg = view / "mlxd"
    pkg.mkdir()
    for f in ("__init__.py", "__main__.py"):
        (pkg / f).symlink_to(tree / "_pkg" / f)
    for name in ("cli", "daemon", "proxy", "engine", "storage_worker", "protocol", "deploy"):
        if (tree / name).is_dir():
            (pkg / name).symlink_to(tree / name)
    return view


def use_tree(tree: Path) -> tuple[Path, str]:
    """Put a view of `tree` first on PYTHONPATH (this process's and the servers'); return the
    view and the tree's commit ("-dirty" with changed tracked files; $BENCH_COMMIT where `tree`
    is no git checkout: `mlxd` refuses unknown MLXD_* variables). Checks that the servers'
    `mlxd` resolves into `tree`. (The lent GPU machine's copy carries a stale .git: its
    results name an old commit; RESULTS.md gives the one that ran.)"""
    view = tree_view(tree)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(view), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(view))
    probe = subprocess.run(
        [sys.executable, "-c", "import mlxd.cli.main as c, mlxd.engine as e, mlxd.proxy as p; "
         "from pathlib import Path; print(*(Path(m.__file__).resolve() for m in (c, e, p)))"],
        capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    for f in probe.stdout.split():
        if not Path(f).is_relative_to(tree):
            raise SystemExit(f"the view of {tree} imports {f}: not that tree")

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *a], capture_output=True,
                              text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:  # a copy without .git (a lent machine's): the commit as the caller says it
        return view, os.environ.get("BENCH_COMMIT", "unknown (no git)")
    return view, head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                         else "")


def random_model(shape: str) -> Path:
    """A random-weight Llama of `shape` with TOOL_TEMPLATE, written once."""
    from support.random_model import write_random_model
    hidden, layers, heads, kv_heads, inter, vocab, context, dtype = SHAPES[shape]
    out = Path(tempfile.gettempdir()) / f"mlxd-bench-agent-{shape}-{dtype}-text"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        write_random_model(tmp, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                           intermediate=inter, vocab=vocab, context=context, dtype=dtype,
                           chat_template=TOOL_TEMPLATE)
        text_only_head(tmp)
        tmp.rename(out)
    return out


def text_only_head(model: Path) -> None:
    """Zero the output rows of tokens that are not whole text (a lone UTF-8 byte, a special
    token): their logits are 0 where about half the others' are positive, so a random model
    never picks them. Otherwise its answer can be all partial bytes, which both servers hold
    back until the end, and no first token or decode rate can be timed."""
    import mlx.core as mx
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    weights = cast(dict[str, mx.array], mx.load(str(model / "model.safetensors")))
    head = weights["lm_head.weight"]
    bad = [i for i in range(head.shape[0])
           if not (t := tok.decode([i], skip_special_tokens=True)) or "\ufffd" in t]
    keep = mx.ones((head.shape[0], 1), dtype=head.dtype)
    keep[mx.array(bad)] = 0
    weights["lm_head.weight"] = head * keep
    mx.save_safetensors(str(model / "model.safetensors"), weights, metadata={"format": "mlx"})


def with_tool_template(model: Path) -> Path:
    """A directory of links to `model`'s files whose tokenizer_config.json has TOOL_TEMPLATE."""
    out = Path(tempfile.gettempdir()) / f"mlxd-bench-agent-{model.name}-tools"
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in model.iterdir():
        if f.name != "tokenizer_config.json":
            (tmp / f.name).symlink_to(f.resolve())
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def model_for(args: argparse.Namespace) -> tuple[Path, str]:
    """(the MLX model directory both servers load, its label in the results' name)."""
    if args.shape:
        return random_model(args.shape), args.shape
    if args.model == "tiny":
        return random_model("tiny"), "tiny"
    if args.model == "default":
        from mlxd.daemon.paths import default_cache_dir
        from mlxd.engine.load.loader import resolve_model_dir
        path = resolve_model_dir("default", default_cache_dir())
        label = "default"
    else:
        path = Path(args.model).expanduser().resolve()
        label = path.name
    if args.template == "tools":
        return with_tool_template(path), label
    return path, label


def context_of(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 0)


# ---------------------------------------------------------------- the trace

EN = ("the a an to of in for on with and or but not when if then use this that these those "
      "file files code tool tools user task tests test change changes edit read write search "
      "command commands output result results error errors function class module project "
      "repository branch commit review always never only before after each every must should "
      "may can prefer avoid keep make sure check run call calls answer concise short clear "
      "existing new path paths line lines content directory working current state step steps "
      "plan todo list item items security secrets style conventions library framework "
      "dependency version build lint format type types value values request response data "
      "parameter parameters option options default explicit absolute relative instead").split()
IDENT = ("cache token session buffer worker engine parser result value index length prefix "
         "offset stream client server model request handler config batch prompt block store "
         "entry layer state queue event chunk shard route header body limit timer").split()
TYPES = ["int", "str", "bytes", "list[int]", "dict[str, Any]", "float", "bool", "None"]


def sentence(rng: random.Random) -> str:
    words = [rng.choice(EN) for _ in range(rng.randint(8, 20))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def code_line(rng: random.Random) -> str:
    a, b, c = rng.choice(IDENT), rng.choice(IDENT), rng.choice(IDENT)
    n, t = rng.randint(0, 4096), rng.choice(TYPES)
    return rng.choice([
        f"def {a}_{b}(self, {c}: {t}) -> {rng.choice(TYPES)}:",
        f"    {a} = self.{b}.get(\"{c}\", {n})",
        f"    if {a}_{b} > {n} and not self.{c}:",
        f"        return {a}.{b}_{c}({n})",
        f"    # {sentence(rng)}",
        f"class {a.capitalize()}{b.capitalize()}({c.capitalize()}):",
        f"    for {a} in self.{b}s[{n}:]:",
        f"        {a}s.append({b}[{c}_{n % 7}])",
        f"from mlxd.{a} import {b}_{c}",
        f"        raise {a.capitalize()}Error(f\"{b} {{{c}}} is over {n}\")",
        "",
    ])


def fill(count: Any, make: Any, tokens: int, sep: str = "\n") -> str:
    """Pieces from `make()` joined by `sep` until about `tokens` tokens (`count` counts)."""
    parts: list[str] = []
    n = 0
    while n < tokens:
        piece = make()
        c = count(piece) + 1
        if parts and n + c > tokens:
            break
        parts.append(piece)
        n += c
    return sep.join(parts)


TOOL_NAMES = ["Bash", "Read", "Edit", "Write", "Glob", "Grep", "TodoWrite", "Task", "WebFetch",
              "WebSearch", "NotebookEdit", "ExitPlanMode"]
CALLED = ["Read", "Read", "Bash", "Grep", "Edit", "Read", "Bash", "Glob"]  # a turn's tool


@dataclass
class Call:
    name: str
    args: dict
    result: str


@dataclass
class SessionTrace:
    task: str
    calls: list[Call]  # calls[k] follows answer k (the last request's answer has none)


@dataclass
class Trace:
    seed: int
    project: str
    system: str
    tools: list[dict]  # OpenAI's shape
    sessions: list[SessionTrace]
    title_system: str
    volatile: bool
    planned_tokens: list[int] = field(default_factory=list)  # each request's estimate

    def volatile_line(self, session: int, request: int, kind: str) -> str:
        """Claude Code's billing line, its hash a new value on every request (the same on
        every server: it is the trace's)."""
        rng = random.Random(f"{self.seed}-{session}-{request}-{kind}")
        return (f"x-anthropic-billing-header: cc_version=2.0.{rng.randint(10, 99)}."
                f"{rng.randint(0, 4095):03x}; cc_entrypoint=cli; cch={rng.getrandbits(20):05x};")

    def system_parts(self, session: int, request: int, kind: str = "turn"
                     ) -> tuple[str | None, str]:
        """(the volatile line or None, the system prompt's text): `kind` "turn", "side" (a
        side request on the conversation) or "title" (a side request with a prompt of its own)."""
        body = self.title_system if kind == "title" else self.system
        line = self.volatile_line(session, request, kind) if self.volatile else None
        return line, body

    def anthropic_tools(self) -> list[dict]:
        return [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in self.tools]


def make_trace(seed: int, tok: Any, args: argparse.Namespace, sessions: int) -> Trace:
    """A trace of `sessions` sessions sharing one system prompt and tool list; sizes in the
    model's tokens (estimated piece by piece with its tokenizer)."""
    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)
    rng = random.Random(seed)
    project = f"{rng.choice(IDENT)}-{rng.choice(IDENT)}-{seed}"
    s = args.scale
    system_tokens = max(200, round(args.system_tokens * s))
    instr = fill(count, lambda: " ".join(sentence(rng) for _ in range(rng.randint(3, 6))),
                 round(system_tokens * 0.3), sep="\n\n")
    system = (f"You are an interactive CLI agent that helps users with software engineering "
              f"tasks in the repository {project}. Use the instructions below and the tools "
              f"available to you to assist the user.\n\n{instr}\n\n# Environment\n<env>\n"
              f"Working directory: /home/user/{project}\nIs directory a git repo: Yes\n"
              f"Platform: linux\nToday's date: 2026-12-03\n</env>")
    names = TOOL_NAMES[:max(3, min(len(TOOL_NAMES), system_tokens // 600))]  # fewer if small
    per_tool = (system_tokens - count(system)) // len(names)
    tools = []
    for name in names:
        props = {}
        for _ in range(rng.randint(2, 5)):
            props[f"{rng.choice(IDENT)}_{rng.choice(IDENT)}"] = {
                "type": rng.choice(["string", "integer", "boolean"]),
                "description": sentence(rng)}
        while True:  # the parameters take at most about half the tool's share
            params = {"type": "object", "properties": props, "required": list(props)[:1],
                      "additionalProperties": False}
            bare = {"type": "function", "function": {"name": name, "description": "",
                                                     "parameters": params}}
            if len(props) == 1 or count(json.dumps(bare)) <= per_tool // 2:
                break
            props.popitem()
        desc = fill(count, lambda: sentence(rng), max(16, per_tool - count(json.dumps(bare))),
                    sep=" ")
        tools.append({"type": "function", "function": {"name": name, "description": desc,
                                                       "parameters": params}})
    lo, hi = args.result_tokens
    traces = []
    fixed = count(system) + sum(count(json.dumps(t)) for t in tools) + 120
    planned = [0]
    for i in range(sessions):
        srng = random.Random(f"{seed}-{i}")
        task = (f"In {project}, " + fill(count, lambda r=srng: sentence(r),
                                         max(20, round(args.task_tokens * s)), sep=" "))
        calls: list[Call] = []
        total = fixed + count(task)
        plan = [total]
        while (len(calls) + 1 < args.turns if args.turns
               else total < args.target_tokens * s):
            size = max(16, round(math.exp(srng.uniform(math.log(lo), math.log(hi))) * s))
            calls.append(tool_call(srng, project, size, count))
            total += size + args.max_tokens + 40
            plan.append(total)
        calls.append(tool_call(srng, project, 16, count))  # (after the last answer: unused)
        traces.append(SessionTrace(task, calls))
        planned = max(planned, plan, key=lambda p: p[-1])
    title_system = ("Generate a concise, sentence-case title (3-7 words) that captures the main "
                    "topic or goal of this coding session. Return only the title.")
    return Trace(seed, project, system, tools, traces, title_system, args.volatile_line,
                 planned)


def tool_call(rng: random.Random, project: str, tokens: int, count: Any) -> Call:
    name = rng.choice(CALLED)
    a, b = rng.choice(IDENT), rng.choice(IDENT)
    path = f"/home/user/{project}/src/{a}/{b}.py"
    if name == "Read":
        lines = iter(range(1, 10**6))
        return Call(name, {"file_path": path},
                    fill(count, lambda: f"{next(lines):6d}\t{code_line(rng)}", tokens))
    if name == "Edit":
        return Call(name, {"file_path": path, "old_string": code_line(rng),
                           "new_string": code_line(rng)},
                    f"The file {path} has been updated. Here's the result of running `cat -n` "
                    "on a snippet of the edited file:\n"
                    + fill(count, lambda: f"{rng.randint(1, 900):6d}\t{code_line(rng)}", tokens))
    if name == "Grep":
        return Call(name, {"pattern": f"def {a}_", "path": "src", "output_mode": "content"},
                    fill(count, lambda: f"src/{rng.choice(IDENT)}/{rng.choice(IDENT)}.py:"
                                        f"{rng.randint(1, 900)}:{code_line(rng)}", tokens))
    if name == "Glob":
        return Call(name, {"pattern": f"src/**/{a}*.py"},
                    fill(count, lambda: f"/home/user/{project}/src/{rng.choice(IDENT)}/"
                                        f"{rng.choice(IDENT)}_{rng.choice(IDENT)}.py", tokens))
    return Call("Bash", {"command": f"python -m pytest -x tests/test_{a}.py -q",
                         "description": f"Run the {a} tests"},
                fill(count, lambda: rng.choice([
                    f"tests/test_{a}.py::test_{rng.choice(IDENT)}_{rng.choice(IDENT)} PASSED",
                    f"tests/test_{a}.py::test_{rng.choice(IDENT)} FAILED",
                    f"E       AssertionError: {rng.choice(IDENT)} {rng.randint(0, 999)} != "
                    f"{rng.randint(0, 999)}",
                    f"src/{a}/{b}.py:{rng.randint(1, 900)}: in {rng.choice(IDENT)}_"
                    f"{rng.choice(IDENT)}", code_line(rng)]), tokens))


# ---------------------------------------------------------------- one request per route

def timing(t0: float, first: float | None, last: float | None, tokens: int) -> dict:
    end = time.perf_counter()
    ttft = (first if first is not None else end) - t0
    decode = ((tokens - 1) / (last - first)
              if first is not None and last is not None and last > first and tokens > 1
              else None)
    return {"ttft_s": ttft, "total_s": end - t0, "decode_tps": decode}


class OpenAIRoute:
    """Chat completions through the openai SDK: the conversation as OpenAI messages."""

    def __init__(self, base: str, model: str, trace: Trace) -> None:
        from openai import AsyncOpenAI
        self.client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                  timeout=3600)
        self.model, self.trace = model, trace

    def start(self, session: int) -> list[dict]:
        return [{"role": "user", "content": self.trace.sessions[session].task}]

    def append(self, conv: list[dict], answer: str, calls: list[tuple[str, dict]],
               results: list[str], call_id: str) -> None:
        ids = [f"{call_id}_{j}" for j in range(len(calls))]
        conv.append({"role": "assistant", "content": answer, "tool_calls": [
            {"id": i, "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for i, (name, args) in zip(ids, calls, strict=True)]})
        for i, result in zip(ids, results, strict=True):
            conv.append({"role": "tool", "tool_call_id": i, "content": result})

    def side(self, conv: list[dict], session: int, mode: str) -> list[dict]:
        if mode == "full":
            return [*conv, {"role": "user", "content": TITLE_ASK}]
        return [{"role": "user", "content": self.trace.sessions[session].task + "\n\n"
                 + TITLE_ASK}]

    async def request(self, system: tuple[str | None, str], conv: list[dict], tools: bool,
                      max_tokens: int) -> dict:
        line, body = system
        messages = [{"role": "system", "content": (line + "\n" if line else "") + body}, *conv]
        extra: dict[str, Any] = {"tools": self.trace.tools} if tools else {}
        t0 = time.perf_counter()
        first = last = None
        text: list[str] = []
        calls: dict[int, list[str]] = {}  # index -> [name, arguments]
        usage = None
        finish = None
        stream = await self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, **extra)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                d = ch.delta
                if d is not None and (d.content or d.tool_calls):
                    first = now if first is None else first
                    last = now
                    text.append(d.content or "")
                    for c in d.tool_calls or ():
                        got = calls.setdefault(c.index, ["", ""])
                        if c.function is not None:
                            got[0] += c.function.name or ""
                            got[1] += c.function.arguments or ""
                if ch.finish_reason:
                    finish, last = ch.finish_reason, now
        details = usage.prompt_tokens_details if usage is not None else None
        completion = usage.completion_tokens if usage is not None else 0
        return {"prompt_tokens": usage.prompt_tokens if usage is not None else None,
                "cached_tokens": details.cached_tokens if details is not None else None,
                "completion_tokens": completion, "finish": finish, "text": "".join(text),
                "tool_calls": [{"name": n, "arguments": a} for _, (n, a) in sorted(calls.items())],
                **timing(t0, first, last, completion)}


class AnthropicRoute:
    """/v1/messages through the anthropic SDK: the conversation as Anthropic messages; the
    system prompt as Claude Code sends it (the billing line a block of its own, the rest a block
    with cache_control; cache_control on the last message's last block too)."""

    def __init__(self, base: str, model: str, trace: Trace) -> None:
        from anthropic import AsyncAnthropic
        self.client = AsyncAnthropic(base_url=base, api_key="none", max_retries=0, timeout=3600)
        self.model, self.trace = model, trace
        self.tools = trace.anthropic_tools()

    def start(self, session: int) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text",
                                              "text": self.trace.sessions[session].task}]}]

    def append(self, conv: list[dict], answer: str, calls: list[tuple[str, dict]],
               results: list[str], call_id: str) -> None:
        ids = [f"{call_id}_{j}" for j in range(len(calls))]
        blocks: list[dict] = [{"type": "text", "text": answer}] if answer else []
        blocks += [{"type": "tool_use", "id": i, "name": name, "input": args}
                   for i, (name, args) in zip(ids, calls, strict=True)]
        conv.append({"role": "assistant", "content": blocks})
        conv.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": i, "content": result}
            for i, result in zip(ids, results, strict=True)]})

    def side(self, conv: list[dict], session: int, mode: str) -> list[dict]:
        if mode == "full":
            return [*conv, {"role": "user", "content": [{"type": "text", "text": TITLE_ASK}]}]
        return [{"role": "user", "content": [{"type": "text", "text":
                                              self.trace.sessions[session].task + "\n\n"
                                              + TITLE_ASK}]}]

    async def request(self, system: tuple[str | None, str], conv: list[dict], tools: bool,
                      max_tokens: int) -> dict:
        line, body = system
        blocks = ([{"type": "text", "text": line + "\n"}] if line else []) + [
            {"type": "text", "text": body, "cache_control": {"type": "ephemeral"}}]
        last_msg = dict(conv[-1])
        last_msg["content"] = [*last_msg["content"][:-1],
                               {**last_msg["content"][-1], "cache_control": {"type": "ephemeral"}}]
        extra: dict[str, Any] = {"tools": self.tools} if tools else {}
        t0 = time.perf_counter()
        first = last = None
        text: list[str] = []
        prompt = cached = None
        out_tokens = 0
        finish = None
        calls: dict[int, list[str]] = {}  # block index -> [name, partial json]
        stream = await self.client.messages.create(
            model=self.model, system=blocks, messages=[*conv[:-1], last_msg],
            max_tokens=max_tokens, stream=True, extra_body={"temperature": 0},  # (the SDK
            **extra)  # 2.16 has no `temperature` argument: the field goes in the body as is)
        async for ev in stream:
            now = time.perf_counter()
            if ev.type == "message_start":
                u = ev.message.usage
                cached = u.cache_read_input_tokens or 0
                prompt = u.input_tokens + cached + (u.cache_creation_input_tokens or 0)
            elif ev.type == "content_block_start" and ev.content_block.type == "tool_use":
                calls[ev.index] = [ev.content_block.name, ""]
            elif ev.type == "content_block_delta":
                piece = getattr(ev.delta, "text", None) or getattr(ev.delta, "partial_json", None)
                if piece:
                    first = now if first is None else first
                    last = now
                    text.append(getattr(ev.delta, "text", "") or "")
                    if ev.index in calls:
                        calls[ev.index][1] += getattr(ev.delta, "partial_json", "") or ""
            elif ev.type == "message_delta":
                out_tokens = ev.usage.output_tokens
                finish, last = ev.delta.stop_reason, now
        return {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": out_tokens,
                "finish": finish, "text": "".join(text),
                "tool_calls": [{"name": n, "arguments": a} for _, (n, a) in sorted(calls.items())],
                **timing(t0, first, last, out_tokens)}


TITLE_ASK = "Summarize this conversation in 5 words."


def calls_to_send(r: dict, call: Call) -> tuple[list[tuple[str, dict]], list[str], str]:
    """The tool calls an agent sends back after answer `r`: the model's own, as the server
    returned them, when it made any that parse (the trace's result answers the first, the others
    get a line); else the trace's call. And which of the two ("model", "trace", or
    "trace (model's unparsable)")."""
    own = []
    for c in r.get("tool_calls") or ():
        try:
            args = json.loads(c["arguments"] or "{}")
        except ValueError:
            args = None
        if not c["name"] or not isinstance(args, dict):
            return [(call.name, call.args)], [call.result], "trace (model's unparsable)"
        own.append((c["name"], args))
    if own:
        return own, [call.result] + ["(no output)"] * (len(own) - 1), "model"
    return [(call.name, call.args)], [call.result], "trace"


# ---------------------------------------------------------------- sessions

async def run_session(route: Any, trace: Trace, session: int, args: argparse.Namespace,
                      requests: int | None = None) -> dict:
    """One session: its requests in turn, a side request between turns."""
    st = trace.sessions[session]
    n = requests or len(st.calls)
    conv = route.start(session)
    turns: list[dict] = []
    sides: list[dict] = []
    t0 = time.perf_counter()
    for k in range(n):
        r = await route.request(trace.system_parts(session, k), conv, True, args.max_tokens)
        r["turn"] = k
        if turns:
            prev = turns[-1]
            r["prev_prompt_tokens"] = prev["prompt_tokens"]
            r["prev_completion_tokens"] = prev["completion_tokens"]
        turns.append(r)
        if k == n - 1:
            break
        prefix = "toolu" if isinstance(route, AnthropicRoute) else "call"
        calls, results, r["calls_sent"] = calls_to_send(r, st.calls[k])
        route.append(conv, r["text"], calls, results, f"{prefix}_{trace.seed}_{session}_{k}")
        if args.side != "none" and (k + 1) % args.side_every == 0:
            kind = "title" if args.side == "short" else "side"
            sr = await route.request(trace.system_parts(session, k, kind),
                                     route.side(conv, session, args.side),
                                     args.side == "full", args.side_tokens)
            sr["after_turn"] = k
            sides.append(sr)
    wall = time.perf_counter() - t0
    return {"session": session, "wall_s": wall, "turns": turns, "side": sides}


async def run_config(config: str, bases: dict[str, str], model: str, trace: Trace,
                     args: argparse.Namespace, requests: int | None = None) -> dict:
    server = "mlx_lm" if config.startswith("mlx_lm") else "mlxd"
    route_cls = AnthropicRoute if config.endswith("anthropic") else OpenAIRoute
    route = route_cls(bases[server], model, trace)
    t0 = time.perf_counter()
    sessions = await asyncio.gather(*(run_session(route, trace, i, args, requests)
                                      for i in range(len(trace.sessions))))
    return {"config": config, "seed": trace.seed, "wall_s": time.perf_counter() - t0,
            "sessions": sessions}


# ---------------------------------------------------------------- servers

def start_servers(model: str, args: argparse.Namespace, work: Path, needed: set[str]
                  ) -> dict[str, tuple[Logged, str]]:
    out = {}
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if "mlxd" in needed:
        port = free_port()
        argv = [sys.executable, "-m", "mlxd.cli.main", "serve", model, "--isolate", "--port",
                str(port), "--run-dir", tempfile.mkdtemp(prefix="mlxd-as-", dir="/tmp"),
                "--cache-dir", str(work / "cache"), "--log-level", "warning",
                *args.mlxd_args.split()]
        out["mlxd"] = (Logged(argv, f"http://127.0.0.1:{port}/health", logs / "mlxd.log"),
                       f"http://127.0.0.1:{port}")
    if "mlx_lm" in needed:
        port = free_port()
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port),
                "--log-level", "WARNING", *args.mlx_lm_args.split()]
        out["mlx_lm"] = (Logged(argv, f"http://127.0.0.1:{port}/health", logs / "mlx_lm.log"),
                         f"http://127.0.0.1:{port}")
    return out


# ---------------------------------------------------------------- main

def machine_label() -> str:
    import mlx.core as mx
    return "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"


async def main_async(args: argparse.Namespace, model: Path, work: Path, save: Any) -> dict:
    """The run; `save(got)` after each whole repetition (a run cut short keeps those)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    needed = {"mlx_lm" if c.startswith("mlx_lm") else "mlxd" for c in args.configs}
    group = {c: 1 if c.endswith("anthropic") else 0 for c in args.configs}
    traces = {(r, g): make_trace(1 + 100 * r + g, tok, args, args.sessions)
              for r in range(args.reps) for g in set(group.values())}
    plan = traces[(0, 0)].planned_tokens if (0, 0) in traces else \
        next(iter(traces.values())).planned_tokens
    print(f"trace: {len(plan)} requests a session, planned prompt tokens "
          f"{plan[0]} -> {plan[-1]} (model context {context_of(model)})", flush=True)
    if context_of(model) and plan[-1] + args.max_tokens > context_of(model):
        raise SystemExit(f"the trace reaches ~{plan[-1]} tokens, over the model's context "
                         f"{context_of(model)}: lower --scale / --target-tokens / --turns")
    servers = start_servers(str(model), args, work, needed)
    STARTED.extend(srv for srv, _ in servers.values())
    bases = {k: base for k, (_, base) in servers.items()}
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    failures: list[dict] = []  # configurations whose run raised (a server that died)
    try:
        for name, (srv, _) in servers.items():
            t0 = time.perf_counter()
            await srv.wait(1800)
            print(f"{name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        warm_args = argparse.Namespace(**{**vars(args), "scale": args.warm_up_scale})
        warm = make_trace(99991, tok, warm_args, 1)
        for name in servers:
            t0 = time.perf_counter()
            cfg = "mlx_lm-openai" if name == "mlx_lm" else "mlxd-openai"
            await run_config(cfg, bases, str(model), warm, args, requests=2)
            if name == "mlxd" and "mlxd-anthropic" in args.configs:
                await run_config("mlxd-anthropic", bases, str(model),
                                 make_trace(99992, tok, warm_args, 1), args, requests=1)
            print(f"{name} warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
        for r in range(args.reps):
            order = args.configs[r % len(args.configs):] + args.configs[:r % len(args.configs)]
            for config in order:
                trace = traces[(r, group[config])]
                try:
                    res = await run_config(config, bases, str(model), trace, args)
                except Exception as e:  # noqa: BLE001 - a server that failed is a result too
                    failures.append({"config": config, "rep": r, "error": repr(e)[:500]})
                    print(f"rep {r} {config:15s} FAILED: {e!r}"[:300], flush=True)
                    continue
                res["rep"], res["position"] = r, order.index(config)
                runs[config].append(res)
                f = rep_figures(res)
                share = f["cache_share_after_first"]
                print(f"rep {r} {config:15s} wall {res['wall_s']:7.1f} s, cache share after "
                      f"turn 1 {'n/a' if share is None else f'{share:.1%}'}, first token "
                      f"{f['first_turn_ttft_s']:.2f} s then median "
                      f"{f['later_ttft_median_s'] or 0:.3f} s (worst {f['worst_ttft_s'] or 0:.2f}"
                      f" s, turn {(f['worst_turn'] or 0) + 1}), decode "
                      f"{f['decode_tps'] or 0:.1f} tok/s, answers reused "
                      f"{f['turns_reusing_previous_answer']}/{f['turns_after_first']}",
                      flush=True)
            if r + 1 < args.reps:
                save({"runs": runs, "failures": failures,
                      "partial": f"{r + 1} of {args.reps} repetitions"})
        full = await stats(bases["mlxd"]) if "mlxd" in bases else None
        mlxd_stats = cache_figures(full) if full is not None else None
    finally:
        for srv, _ in servers.values():
            srv.stop()
            STARTED.remove(srv)
    return {"runs": runs, "failures": failures, "mlxd_cache": mlxd_stats, "mlxd_stats": full,
            "trace": {"system_chars": len(traces[(0, 0 if 0 in group.values() else 1)].system),
                      "planned_tokens": plan}}


def resummarize(path: Path, out: Path | None, args: argparse.Namespace) -> None:
    """--from-json: the summary, goals and tables of a results file computed again (with
    --measure-inprocess, after measuring its in-process reference here)."""
    data = json.loads(path.read_text())
    if args.measure_inprocess:
        step = args.inprocess_prefill_step or prefill_step_of(
            data.get("settings", {}).get("mlx_lm_args", ""))
        data["inprocess"] = run_reference(data["runs"], Path(data["model_dir"]),
                                          args.inprocess_reps, step)
    data["summary"] = summarize(data["runs"])
    data["per_turn"] = per_turn(data["runs"])
    n = sessions_of(data["runs"])
    data["goals"] = goals(data["summary"], n)
    data["tables"] = tables(data["summary"], data["per_turn"], data.get("inprocess"), n)
    (out or path).write_text(json.dumps(data, indent=1, default=str))
    print(data["tables"])


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny",
                    help="tiny (random float32, context 65,536), default (SmolLM2-135M), or an "
                         "MLX model directory")
    ap.add_argument("--shape", choices=["tiny", "1b", "8b"], default=None,
                    help="a random bfloat16 Llama of this shape instead of --model")
    ap.add_argument("--template", choices=["tools", "model"], default="tools",
                    help="for --model default or a directory: TOOL_TEMPLATE (renders tools) or "
                         "the model's own chat template")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=1, help="sessions at once (1-4)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every token size")
    ap.add_argument("--system-tokens", type=int, default=8000,
                    help="system prompt and tool definitions, at scale 1")
    ap.add_argument("--result-tokens", default="500,4000",
                    help="a tool result's size range at scale 1 (log-uniform)")
    ap.add_argument("--task-tokens", type=int, default=150, help="the first user message")
    ap.add_argument("--target-tokens", type=int, default=None,
                    help="grow each session to this prompt size at scale 1 (default 32,768 on "
                         "the CPU, 65,536 on a GPU)")
    ap.add_argument("--turns", type=int, default=None,
                    help="requests per session (instead of --target-tokens)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--side", choices=["short", "full", "none"], default="short",
                    help="the title request between turns: its own short prompt, the whole "
                         "conversation, or none")
    ap.add_argument("--side-every", type=int, default=1, help="a side request every N turns")
    ap.add_argument("--side-tokens", type=int, default=16, help="the side request's max_tokens")
    ap.add_argument("--volatile-line", action="store_true",
                    help="a billing line at the top of the system prompt, new on every request")
    ap.add_argument("--warm-up-scale", type=float, default=None,
                    help="--scale of each server's warm-up session (default: --scale)")
    ap.add_argument("--mlxd-args", default="", help="extra `mlxd serve` flags")
    ap.add_argument("--mlx-lm-args", default="", help="extra `mlx_lm.server` flags")
    ap.add_argument("--tree", type=Path, default=HERE.parent,
                    help="the mlxd checkout the servers run (default: this file's)")
    ap.add_argument("--machine", default=None, help="in the result's name (default: cpu/gpu)")
    ap.add_argument("--tag", default=None,
                    help="appended to the result's name (default: 'volatile' with "
                         "--volatile-line, else nothing)")
    ap.add_argument("--no-inprocess", dest="inprocess", action="store_false",
                    help="no in-process mlx-lm reference after the servers")
    ap.add_argument("--inprocess-reps", type=int, default=None,
                    help="the in-process reference for the first N repetitions only "
                         "(default: all)")
    ap.add_argument("--inprocess-prefill-step", type=int, default=None,
                    help="the reference's prefill_step_size (default: mlx_lm.server's "
                         "--prefill-step-size in --mlx-lm-args, else mlx-lm's 2048)")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="no run: the summary, goals and tables of this results file computed "
                         "again (written back, or to --out)")
    ap.add_argument("--measure-inprocess", action="store_true",
                    help="with --from-json: measure the file's in-process reference first (its "
                         "model directory must be on this machine)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/agent_session-<model>-<machine>[-<tag>]"
                         ".json")
    args = ap.parse_args()
    if args.from_json:
        return resummarize(args.from_json, args.out, args)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.configs:
        if c not in CONFIGS:
            ap.error(f"--configs: {c} is not one of {', '.join(CONFIGS)}")
    lo, hi = (int(x) for x in args.result_tokens.split(","))
    args.result_tokens = (lo, hi)
    if args.warm_up_scale is None:
        args.warm_up_scale = args.scale
    view, commit = use_tree(args.tree.resolve())
    machine = args.machine or machine_label()
    if args.target_tokens is None:
        args.target_tokens = 32768 if machine_label() == "cpu" else 65536
    model, label = model_for(args)
    print(f"mlxd {commit} from {args.tree.resolve()} (view {view}); model {model}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="mlxd-bench-agent-"))
    print(f"work directory (servers' logs in logs/): {work}", flush=True)
    t0 = time.time()
    # SIGTERM (`timeout`, a job's end) as an interrupt: the servers are stopped on the way out
    signal.signal(signal.SIGTERM, interrupted)
    from importlib.metadata import version
    tag = args.tag if args.tag is not None else "volatile" if args.volatile_line else ""
    name = "-".join(filter(None, ["agent_session", label, machine, tag]))
    out = args.out or HERE / "results" / f"{name}.json"

    def save(got: dict) -> str:
        summary = summarize(got["runs"])
        turns = per_turn(got["runs"])
        text = tables(summary, turns, got.get("inprocess"), sessions_of(got["runs"]))
        data = {"model": label, "model_dir": str(model), "machine": machine,
                "platform": platform.platform(), "cpus": os.cpu_count(), "mlxd_commit": commit,
                "mlxd_tree": str(args.tree.resolve()),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
                "openai": version("openai"), "anthropic": version("anthropic"),
                "argv": sys.argv[1:],
                "settings": {k: v for k, v in vars(args).items() if k not in ("tree", "out")},
                "seconds": time.time() - t0, "summary": summary, "per_turn": turns,
                "goals": goals(summary, sessions_of(got["runs"])), "tables": text, **got}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, default=str))
        return text
    try:
        got = asyncio.run(main_async(args, model, work, save))
    finally:
        for srv in STARTED:
            srv.stop()
    if args.inprocess and got["runs"].get("mlxd-openai"):
        save(got)  # the servers' figures kept, should the reference be cut short
        try:  # the servers stopped: the machine is the reference's alone
            got["inprocess"] = run_reference(
                got["runs"], model, args.inprocess_reps,
                args.inprocess_prefill_step or prefill_step_of(args.mlx_lm_args), hide=[str(view)])
        except KeyboardInterrupt:
            got["inprocess"] = {"skipped": "interrupted (the turns measured kept)"}
            save(got)
            raise
    text = save(got)
    print()
    print(f"{label} model, {machine}, mlxd {commit}; {args.sessions} session(s) at once; "
          f"median (min-max) of {args.reps} interleaved repetitions")
    print(text)
    print(f"\nwritten {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
