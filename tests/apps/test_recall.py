"""RotaryEmbedding, MultiHeadAttention(rotary=), RecallLM and the long view of `attnkit show`."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.models.recall import RecallLM, Task, accuracy, compressed_recall, make_batch, train
from attnkit.nn import RotaryEmbedding

# --- rotary embeddings ----------------------------------------------------------------------------


def test_rotary_equals_transformers_llama_formula():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0)
    rope_hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    q, k = torch.randn(2, 4, 11, 16), torch.randn(2, 4, 11, 16)
    positions = torch.arange(5, 16)[None].expand(2, -1)
    cos, sin = rope_hf(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(16, 10000.0)
    torch.testing.assert_close(ours(q, positions), want_q)
    torch.testing.assert_close(ours(k, positions[0]), want_k)


def test_partial_rotary_keeps_the_rest_and_depends_on_distance_only():
    rope = RotaryEmbedding(16, 10000.0, rotary_dims=8)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    rotated = rope(q, torch.tensor([7]))
    torch.testing.assert_close(rotated[..., 8:], q[..., 8:])
    dots = [(rope(q, torch.tensor([p])) * rope(k, torch.tensor([p + 3]))).sum() for p in (0, 100, 5000)]
    torch.testing.assert_close(dots[0], dots[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dots[0], dots[2], atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="rotary_dims"):
        RotaryEmbedding(16, rotary_dims=7)
    with pytest.raises(ValueError, match="positions"):
        rope(q, torch.arange(3))


def test_rotary_attention_decodes_with_the_cache_as_it_runs_whole():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, rotary=RotaryEmbedding(8, 500.0)).eval()
    x = torch.randn(2, 9, 32)
    whole, _ = mha(x, mask=masks.causal())
    cache = attnkit.KVCache(2, 2, 16, 8)
    steps = [mha(x[:, :5], mask=masks.causal(), cache=cache)[0]]
    for t in range(5, 9):
        steps.append(mha(x[:, t : t + 1], mask=masks.causal(), cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="self-attention"):
        mha(x, torch.randn(2, 4, 32))


# --- the task and the model -----------------------------------------------------------------------


def test_recall_texts_hold_their_answers():
    task = Task()
    tokens, targets = make_batch(3, 300, pairs=6, queries=3, generator=torch.Generator().manual_seed(0), depth=0.5)
    for row, target in zip(tokens, targets):
        answers = (target != -100).nonzero().flatten()
        assert len(answers) == 3
        for at in answers.tolist():
            assert int(row[at - 1]) == Task.QUERY and task.first_key <= int(row[at]) < task.first_value
            stated = (row[: at - 1] == row[at]).nonzero().flatten()
            assert len(stated) == 1  # each key is stated once before the queries
            assert int(row[stated[0] + 1]) == int(target[at]) == int(row[at + 1])
    with pytest.raises(ValueError, match="cannot hold"):
        make_batch(1, 10, pairs=8)


def test_recall_model_checks_its_inputs():
    model = RecallLM()
    with pytest.raises(ValueError, match="RecallLM knows"):
        model.tokenize("the k1 v2 banana")
    with pytest.raises(TypeError, match="int64"):
        model(torch.randn(1, 5))
    with pytest.raises(ValueError, match=r"\[0, "):
        model(torch.tensor([[1, 10_000]]))
    assert model.answer(model.tokenize("the of k3 v7 and"))[0] == ("", 0.0)  # no question: no answer


def test_training_smoke():
    model, record = train(steps=12, batch_size=4, min_length=64, max_length=96, progress=False, log=None)
    assert record["steps"] == 12 and record["history"][-1]["step"] == 12  # evaluated every steps // 10 steps
    assert all(0.0 <= h["accuracy_256"] <= 1.0 and h["loss"] > 0 for h in record["history"])
    assert isinstance(model, RecallLM) and not model.training


@pytest.fixture(scope="module")
def shipped():
    return RecallLM.from_package()


def test_shipped_model_answers_at_1k(shipped):
    assert accuracy(shipped, 1024, n=48, seed=7) >= 0.95


def test_shipped_model_answers_a_written_question(shipped):
    text = "the of k12 v40 and to in was " * 3 + "that for k5 v9 on as ? k12"
    assert shipped.answer(shipped.tokenize(text))[0][0] == "v40"


def test_decoding_with_caches_equals_the_whole_text(shipped):
    tokens, _ = make_batch(2, 200, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = shipped(tokens)
        caches = shipped.new_caches(2, 200)
        parts = [shipped(tokens[:, :150], caches=caches)]
        parts += [shipped(tokens[:, t : t + 1], caches=caches, before=tokens[:, t - 1]) for t in range(150, 200)]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="pass before="):
        shipped(tokens[:, :1], caches=caches)
    with pytest.raises(ValueError, match="one per layer"):
        shipped(tokens, caches=caches[:1])


def test_compressed_recall_full_cache_answers_as_the_model_does(shipped):
    found = compressed_recall(shipped, 300, keep=(1.0, 0.5), n=12, seed=5, batch_size=6)
    assert found["full"] == accuracy(shipped, 300, n=12, seed=5, batch_size=6)  # the same texts, read with caches
    for method in ("snapkv", "tova", "observed", "random", "recent"):
        assert found[method][1.0] == found["full"]  # keeping everything changes nothing
        assert 0.0 <= found[method][0.5] <= 1.0
    with pytest.raises(ValueError, match="methods must be among"):
        compressed_recall(shipped, 300, methods=["h2o"], n=2)


# --- the long view ---------------------------------------------------------------------------------


def test_show_writes_the_long_view_without_an_l_by_l_matrix(tmp_path):
    pytest.importorskip("matplotlib")
    import numpy as np

    from attnkit.cli import main

    out = tmp_path / "long"
    assert main(["show", "--model", "recall", "--length", "3000", "--rows", "0,-1", "--out", str(out)]) == 0
    for name in ("long.html", "long_heads.png", "long_keymass.png", "long_rows.png", "attention_stats.npz"):
        assert (out / name).is_file(), name
    assert (out / "long.html").stat().st_size < 10 * 2**20
    data = np.load(out / "attention_stats.npz")
    length = data["tokens"].shape[0]
    assert length == 3000 and data["entropy_bits"].shape == (2, 4, length)  # --length tokens, the last "? key"
    most = np.log2(np.arange(2, length + 2))  # bits: row i sees i + 1 keys (and maybe a sink)
    assert (data["entropy_bits"] <= most + 1e-3).all()
    assert data["row_weights"].shape == (2, 4, 2, length)
    np.testing.assert_allclose(data["row_weights"].sum(-1), 1.0, atol=1e-4)  # rows of weights, exact
    np.testing.assert_allclose(data["received"].sum(-1), length, rtol=1e-4)  # every query's mass lands somewhere


def test_show_file_and_bad_arguments(tmp_path, capsys):
    from attnkit.cli import main

    text = tmp_path / "t.txt"
    text.write_text("the of k3 v7 and to ? k3", encoding="utf-8")
    assert main(["show", "--model", "recall", "--file", str(text), "--out", str(tmp_path / "f")]) == 0
    assert "RecallLM answers: v7" in capsys.readouterr().out
    assert main(["show", "--model", "recall", "--file", str(text), "--rows", "99", "--out", str(tmp_path / "g")]) == 2
    assert "--rows" in capsys.readouterr().err
    assert main(["show", "a", "--file", str(text), "--out", str(tmp_path / "h")]) == 2
    assert main(["show", "--out", str(tmp_path / "h")]) == 2
