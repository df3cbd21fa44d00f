"""A model directory whose config has a `vision_config` is served by the vision engine only
when mlxd serves images for its family and the directory holds its tower; anything else that
mlx-lm loads is served as a text model (`engine/kinds/route.py`): Qwen3.5's checkpoints, for
one, ship a multimodal config, and a text conversion of Gemma 3 keeps that config without the
tower. Before, such a directory was refused at load ("mlxd serves vision models of the
families ...") or failed inside mlx-vlm."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import mlx.core as mx

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.engine.kinds.route import (
    is_vision_weight,
    mlx_lm_loads,
    route_vision_config,
    weight_names,
)
from support.random_model import write_random_model

SERVED = frozenset({"llava", "gemma3", "qwen2_5_vl"})
LLAVA = ["vision_tower.vision_model.embeddings.patch_embedding.weight",
         "multi_modal_projector.linear_1.weight", "language_model.model.embed_tokens.weight"]
QWEN = ["model.visual.patch_embed.proj.weight", "model.language_model.embed_tokens.weight"]
TEXT_ONLY = ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight"]


def route(model_type: str, names: list[str], text_types: set[str]) -> tuple[str, str]:
    r = route_vision_config({"model_type": model_type, "vision_config": {}}, names, SERVED,
                            lambda t: t in text_types)
    return r.kind, r.why


def test_a_served_family_with_its_tower_is_a_vision_engine():
    assert route("llava", LLAVA, {"llava"}) == ("vision", "")
    assert route("qwen2_5_vl", QWEN, {"qwen2_5_vl"}) == ("vision", "")


def test_a_served_family_without_its_tower_is_a_text_engine_where_mlx_lm_loads_it():
    kind, why = route("gemma3", TEXT_ONLY, {"gemma3"})
    assert kind == "text" and "without a vision tower" in why
    # neither can serve it: the vision engine's refusal at load says why
    assert route("gemma3", TEXT_ONLY, set())[0] == "vision"


def test_a_family_without_image_support_is_a_text_engine_where_mlx_lm_loads_it():
    kind, why = route("qwen3_5", QWEN, {"qwen3_5"})
    assert kind == "text" and "qwen3_5" in why and "llava" in why
    assert route("qwen3_5", QWEN, set())[0] == "vision"


def test_vision_weights_are_told_by_their_names_first_parts():
    assert all(is_vision_weight(n) for n in (LLAVA[0], QWEN[0], "visual.blocks.0.attn.weight",
                                              "model.vision_model.encoder.layers.0.weight"))
    assert not any(is_vision_weight(n) for n in TEXT_ONLY + [
        "multi_modal_projector.linear_1.weight",
        "language_model.model.layers.0.vision_gate.weight"])


def test_mlx_lm_loads_what_it_has_a_model_for():
    assert mlx_lm_loads("qwen3_5") and mlx_lm_loads("gemma3") and mlx_lm_loads("lfm2-vl")
    assert not mlx_lm_loads("idefics3") and not mlx_lm_loads("no_such_model")
    assert not mlx_lm_loads("../qwen3") and not mlx_lm_loads("")


def test_weight_names_come_from_the_index_or_each_files_header(tmp_path):
    mx.save_safetensors(str(tmp_path / "a.safetensors"), {"visual.w": mx.zeros((2,))})
    mx.save_safetensors(str(tmp_path / "b.safetensors"), {"lm_head.weight": mx.zeros((2,))})
    assert sorted(weight_names(tmp_path)) == ["lm_head.weight", "visual.w"]
    (tmp_path / "c.safetensors").write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    assert sorted(weight_names(tmp_path)) == ["lm_head.weight", "visual.w"]  # damaged: skipped
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x.weight": "a.safetensors"}}))
    assert weight_names(tmp_path) == ["x.weight"]


def qwen3_5_checkpoint(out: Path) -> Path:
    """A tiny Qwen3.5 as its checkpoints ship: a multimodal config and a vision tower's
    weights beside the language model's (mlx-lm's sanitize drops them)."""
    d = write_random_model(out, family="qwen3_5", context=1024)
    loaded = mx.load(str(d / "model.safetensors"))
    assert isinstance(loaded, dict)
    weights = dict(loaded)
    weights["model.visual.patch_embed.proj.weight"] = mx.random.normal((32, 3, 2, 16, 16))
    mx.save_safetensors(str(d / "model.safetensors"), weights, metadata={"format": "mlx"})
    return d


def png_b64() -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_a_qwen3_5_checkpoint_is_served_as_text_and_refuses_images(tmp_path):
    from mlx_lm import load, stream_generate

    model = qwen3_5_checkpoint(tmp_path / "qwen3_5")
    prompt = [11, 42, 97, 250, 7, 64, 128, 33, 19, 5, 77, 88]
    m, tok = load(str(model))[:2]
    want = "".join(r.text for r in stream_generate(m, tok, prompt, max_tokens=10))
    d = start_daemon(model, isolate=True)
    try:
        with d.http() as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10,
                                                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            r = c.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url",
                     "image_url": {"url": "data:image/png;base64," + png_b64()}}]}]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "does not take images" in err["message"] and "text model" in err["message"]
            r = c.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [
                {"role": "user", "content": "still there?"}]})
            assert r.status_code == 200, r.text
        assert d.stats()["engines"][0]["restarts"] == 0
        assert "served as a text model" in d.log()
    finally:
        stop(d)


def test_a_gemma3_text_conversion_routes_to_text_and_the_text_loader_loads_it(tmp_path):
    """What `mlx_lm.convert` makes of Gemma 3: its multimodal config, no tower's weights."""
    from mlxd.engine.kinds.vision.model import SUPPORTED
    from mlxd.engine.load.loader import load_model
    from support.random_vlm import write_random_gemma3

    d = write_random_gemma3(tmp_path / "gemma3", image_size=56, image_tokens=4)
    loaded = mx.load(str(d / "model.safetensors"))
    assert isinstance(loaded, dict)
    text = {k: v for k, v in loaded.items()
            if not k.startswith(("vision_tower.", "multi_modal_projector."))}
    assert len(text) < len(loaded)
    config = json.loads((d / "config.json").read_text())
    assert route_vision_config(config, weight_names(d), SUPPORTED, mlx_lm_loads).kind == "vision"
    mx.save_safetensors(str(d / "model.safetensors"), text, metadata={"format": "mlx"})
    assert route_vision_config(config, weight_names(d), SUPPORTED, mlx_lm_loads).kind == "text"
    model, _, _ = load_model(str(d), tmp_path / "cache")
    assert model(mx.array([[1, 2, 3]])).shape[:2] == (1, 3)
