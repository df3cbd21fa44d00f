"""One image question through the Anthropic and Ollama dialects (the vision tests' shared part)."""

from __future__ import annotations

from support.harness import Daemon


def other_dialect_answers(d: Daemon, model: str, image_b64: str, question: str,
                          tokens: int) -> list[str]:
    """Greedy answers from /v1/messages, /api/chat and /api/generate, each a 200; and
    /api/show lists the "vision" capability Ollama clients look for."""
    with d.http() as c:
        r = c.post("/v1/messages", json={
            "model": model, "max_tokens": tokens, "temperature": 0, "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": image_b64}},
                    {"type": "text", "text": question}]}]})
        assert r.status_code == 200, r.text
        answers = [r.json()["content"][0]["text"]]
        options = {"temperature": 0, "num_predict": tokens}
        r = c.post("/api/chat", json={
            "model": model, "stream": False, "options": options,
            "messages": [{"role": "user", "content": question, "images": [image_b64]}]})
        assert r.status_code == 200, r.text
        answers.append(r.json()["message"]["content"])
        r = c.post("/api/generate", json={
            "model": model, "stream": False, "prompt": question, "images": [image_b64],
            "options": options})
        assert r.status_code == 200, r.text
        answers.append(r.json()["response"])
        r = c.post("/api/show", json={"model": model})
        assert "vision" in r.json()["capabilities"], r.text
    return answers
