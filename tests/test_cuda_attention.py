"""The engine's default for MLX's cuDNN attention on CUDA (engine/cuda_attention.py)."""

import os

import pytest

from mlxd.engine.load import cuda_attention


def test_an_engine_turns_cudnn_attention_off_unless_the_user_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda_attention.ENV, raising=False)
    assert cuda_attention.apply() == "0"
    assert os.environ[cuda_attention.ENV] == "0"  # what MLX's CUDA backend reads, once
    monkeypatch.setenv(cuda_attention.ENV, "1")
    assert cuda_attention.apply() == "1" and os.environ[cuda_attention.ENV] == "1"

