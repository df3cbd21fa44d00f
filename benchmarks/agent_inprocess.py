"""The in-process mlx-lm reference of benchmarks/agent_session.py (issue 33): what each of mlxd's
turns would cost with mlx-lm called directly, no server, no HTTP, no tokenizer.

After the servers have stopped, a child process (the same interpreter, mlx-lm only: nothing of
mlxd is imported) loads the same model directory with `mlx_lm.load` and replays every session of
the `mlxd-openai` runs, turn by turn, from the (prompt_tokens p_k, cached_tokens c_k,
completion_tokens n_k) mlxd reported:

- the KV cache (one per session, `make_prompt_cache`) is brought to exactly c_k tokens: trimmed
  back (`trim_prompt_cache`) when it holds more (the previous turn's prompt and answer, of which
  the server reused only part), the gap prefilled untimed (in `prefill_step` chunks) when it
  holds fewer;
- timed: `mlx_lm.generate.generate_step` over p_k - c_k random token ids (timing does not depend
  on the ids) with that cache, greedy, `max_tokens` n_k: first token time = from the call up to
  the first generated token (the uncached prefill included; everything evaluated before the
  clock starts), decode rate = the tokens after the first over the time from the first to the
  last (the client's definition);
- the cache then holds p_k + n_k tokens; the next turn trims or extends it from there.

A short untimed generation warms the kernels up first; `mx.clear_cache()` between sessions.
When the server reused the whole prompt (c_k = p_k), the last token is taken as uncached (a
first token needs one). Sessions are measured one at a time, alone on the machine, whereas the
servers ran `--sessions` at once.

    python benchmarks/agent_inprocess.py PLAN.json    # (the child; agent_session.py runs it)

PLAN.json: {"model": dir, "prefill_step": N, "sessions": [{"rep": r, "session": i, "turns":
[[p, c, n], ...]}]}; one JSON line a session on stdout ({"rep", "session", "turns": [{"turn",
"inproc_ttft_s", "inproc_decode_tps", ...}]}, then {"done": ...}); progress on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

MLX_LM_PREFILL_STEP = 2048  # mlx_lm.generate.generate_step's and mlx_lm.server's default


# ---------------------------------------------------------------- the parent's side

def reference_plan(runs: dict[str, list[dict]], reps: int | None) -> list[dict]:
    """The sessions to replay: each of the first `reps` (None: all) `mlxd-openai` repetitions'
    sessions, as [[prompt, cached, completion], ...] per turn (None for a failed turn)."""
    out = []
    for run in runs.get("mlxd-openai", []):
        if reps is not None and run["rep"] >= reps:
            continue
        for s in run["sessions"]:
            out.append({"rep": run["rep"], "session": s["session"], "turns": [
                [t["prompt_tokens"], t["cached_tokens"] or 0, t["completion_tokens"] or 0]
                if t.get("prompt_tokens") else None for t in s["turns"]]})
    return out


def prefill_step_of(mlx_lm_args: str) -> int:
    """mlx_lm.server's --prefill-step-size in `--mlx-lm-args`, else mlx-lm's default."""
    words = mlx_lm_args.replace("=", " ").split()
    if "--prefill-step-size" in words:
        return int(words[words.index("--prefill-step-size") + 1])
    return MLX_LM_PREFILL_STEP


def run_reference(runs: dict[str, list[dict]], model: Path, reps: int | None,
                  prefill_step: int, hide: list[str] | None = None) -> dict:
    """Measure the reference in a child process and write `inproc_ttft_s` and
    `inproc_decode_tps` into the `mlxd-openai` turns of `runs` (in place). `hide`: PYTHONPATH
    entries the child is not given (the mlxd tree's view). Returns what the phase did."""
    plan = reference_plan(runs, reps)
    if not plan:
        return {"skipped": "no mlxd-openai sessions"}
    t0 = time.perf_counter()
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (hide or [])]
    env["PYTHONPATH"] = os.pathsep.join(path)
    by_key = {(r["rep"], s["session"]): s for r in runs["mlxd-openai"] for s in r["sessions"]}
    info: dict[str, Any] = {"prefill_step": prefill_step, "model_dir": str(model),
                            "reps": sorted({p["rep"] for p in plan}),
                            "sessions_planned": len(plan), "sessions_measured": 0}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(model), "prefill_step": prefill_step, "sessions": plan}, f)
    print(f"in-process reference: {len(plan)} session(s) of reps {info['reps']}, "
          f"prefill step {prefill_step}", flush=True)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), f.name],
                            stdout=subprocess.PIPE, text=True, env=env,
                            cwd=tempfile.gettempdir())
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            got = json.loads(line)
            if "done" in got:
                info.update(got["done"])
                continue
            session = by_key[(got["rep"], got["session"])]
            for t, m in zip(session["turns"], got["turns"], strict=True):
                t.update({k: v for k, v in m.items() if k != "turn"})
            info["sessions_measured"] += 1
        info["returncode"] = proc.wait()
        if info["returncode"]:
            print(f"in-process reference: the child exited {info['returncode']} after "
                  f"{info['sessions_measured']} of {len(plan)} sessions", flush=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(f.name)
    info["seconds"] = time.perf_counter() - t0
    return info


# ---------------------------------------------------------------- the child

def measure(plan_file: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, generation_stream, wired_limit
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    plan = json.loads(plan_file.read_text())
    step: int = plan["prefill_step"]
    t0 = time.perf_counter()
    model = load(plan["model"])[0]
    config = json.loads((Path(plan["model"]) / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])
    print(f"in-process: model loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
          flush=True)

    def ids(n: int) -> mx.array:
        x = mx.random.randint(0, vocab, (n,), dtype=mx.int32)
        mx.eval(x)
        return x

    def prefill(cache: list[Any], n: int) -> None:
        """n random tokens into `cache`, untimed, in `step` chunks (as generate_step does)."""
        x = ids(n)
        for i in range(0, n, step):
            with mx.stream(generation_stream):
                model(x[i:i + step][None], cache=cache)
            mx.eval([c.state for c in cache])

    def held(cache: list[Any]) -> int:
        return int(cache[0].offset)

    def turn(cache: list[Any], prompt: int, completion: int) -> tuple[float, float | None]:
        """generate_step over `prompt` new tokens: (first token s, decode tok/s)."""
        x = ids(prompt)
        if held(cache):
            mx.eval([c.state for c in cache])
        first = last = None
        got = 0
        t = time.perf_counter()
        for _tok, _ in generate_step(x, model, prompt_cache=cache, max_tokens=completion,
                                     prefill_step_size=step):  # (yields tok.item(): evaluated)
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            got += 1
        assert first is not None and last is not None
        decode = (got - 1) / (last - first) if got > 1 and last > first else None
        return first - t, decode

    totals = {"untimed_prefill_tokens": 0, "trimmed_tokens": 0, "rebuilt_caches": 0}

    def replay(turns: list[list[int] | None]) -> list[dict]:
        """One session's turns over one cache, brought to each turn's cached tokens."""
        cache = make_prompt_cache(model)
        out: list[dict] = []
        for k, t in enumerate(turns):
            if t is None:
                out.append({"turn": k, "inproc_ttft_s": None, "inproc_decode_tps": None})
                continue
            prompt, cached, completion = t
            cached = min(cached, prompt - 1)  # a first token needs one uncached token
            trimmed = 0
            if held(cache) > cached:
                if can_trim_prompt_cache(cache):
                    before = held(cache)
                    trim_prompt_cache(cache, before - cached)
                    trimmed = before - held(cache)
                if held(cache) > cached:  # not trimmable: start over
                    cache = make_prompt_cache(model)
                    totals["rebuilt_caches"] += 1
            gap = cached - held(cache)
            if gap:
                prefill(cache, gap)
            ttft, decode = turn(cache, prompt - cached, max(1, completion))
            totals["untimed_prefill_tokens"] += gap
            totals["trimmed_tokens"] += trimmed
            out.append({"turn": k, "inproc_ttft_s": ttft, "inproc_decode_tps": decode,
                        "inproc_uncached": prompt - cached, "inproc_trimmed": trimmed,
                        "inproc_untimed_prefill": gap})
        return out

    with wired_limit(model, [cast(Any, generation_stream)]):
        warm = make_prompt_cache(model)  # kernels compiled and buffers sized before any timing
        turn(warm, min(2 * step, 4096), 8)
        del warm
        mx.clear_cache()
        for s in plan["sessions"]:
            ts = time.perf_counter()
            out = replay(s["turns"])
            mx.clear_cache()
            print(json.dumps({"rep": s["rep"], "session": s["session"], "turns": out}),
                  flush=True)
            print(f"in-process: rep {s['rep']} session {s['session']}: {len(out)} turns in "
                  f"{time.perf_counter() - ts:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps({"done": {**totals, "peak_memory_gb": mx.get_peak_memory() / 1e9,
                               "device": str(mx.default_device()),
                               "mlxd_imported": any(m.split(".")[0] == "mlxd"
                                                    for m in sys.modules)}}), flush=True)


if __name__ == "__main__":
    measure(Path(sys.argv[1]))
