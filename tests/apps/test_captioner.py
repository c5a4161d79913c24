"""DigitCaptioner: captions of real handwritten digits, with attention over image regions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")


from attnkit.cli import main
from attnkit.models import (
    DigitCaptioner,  # noqa: E402
    captioner,  # noqa: E402
)


@pytest.fixture(scope="module")
def model():
    return DigitCaptioner.from_package()


def test_the_splits_are_by_index_and_disjoint():
    test, train = set(captioner.split("test").tolist()), set(captioner.split("train").tolist())
    assert not test & train and len(test) + len(train) == 1797
    assert all(i % 5 == 0 for i in test)


def test_shipped_weights_caption_test_split_strips(model):
    rng = random.Random(1234)
    strips = [captioner.sample(rng, "test", (2, 6)) for _ in range(150)]
    captions = model.caption([image for _, image, _ in strips])
    exact = sum(c == truth for c, (_, _, truth) in zip(captions, strips)) / len(strips)
    words = [(g, w) for c, (_, _, truth) in zip(captions, strips) for g, w in zip(c.split(), truth.split())]
    assert exact >= 0.85, exact
    assert sum(g == w for g, w in words) / sum(len(t.split()) for _, _, t in strips) >= 0.95


def test_numpy_hstack_of_load_digits_images_is_accepted(model):
    from sklearn.datasets import load_digits

    data = load_digits()
    index = [i for i in captioner.split("test").tolist()][:3]
    image = np.hstack([data.images[i] for i in index])
    assert model.caption([image]) == model.caption([torch.tensor(image, dtype=torch.float32)])


def test_decoding_with_the_cache_equals_full_recomputation(model):
    rng = random.Random(5)
    images = [captioner.sample(rng, "test", (1, 8))[1] for _ in range(6)]
    for image in images:
        ids = model.generate([image])[0].tolist()
        ids = ids[: ids.index(captioner.EOS) + 1] if captioner.EOS in ids else ids
        words_in = torch.tensor([[captioner.BOS] + ids[:-1]])
        with torch.no_grad():
            full = model([image], words_in).argmax(-1)[0].tolist()
        assert full == ids


def test_batched_strips_of_different_widths_caption_as_one_by_one(model):
    rng = random.Random(9)
    images = [captioner.sample(rng, "test", (1, 8))[1] for _ in range(12)]
    assert len({img.shape[1] for img in images}) > 1
    assert model.caption(images) == [model.caption([img])[0] for img in images]


def test_caption_with_attention_shapes(model):
    image = captioner.strip_of(captioner.split("test")[:3].tolist())
    result = model.caption_with_attention(image)
    layers, heads, words, patches = result["weights"].shape
    assert (layers, heads) == (2, 4) and words == len(result["words"]) and patches == 2 * 6
    assert result["grid"] == (2, 6)
    assert torch.allclose(result["weights"].sum(-1), torch.ones(layers, heads, words), atol=1e-5)


def test_training_smoke():
    model, record = captioner.train(12, seed=1, batch_size=16, progress=False)
    assert record["final_loss"] < record["first_loss"]
    assert isinstance(model, DigitCaptioner) and not model.training


def test_bad_images_get_clear_errors(model):
    with pytest.raises(ValueError, match=r"must have shape \(8, 8n\)"):
        model.caption([torch.zeros(8, 7)])
    with pytest.raises(ValueError, match=r"must have shape \(8, 8n\)"):
        model.caption([torch.zeros(3, 8, 8)])
    with pytest.raises(ValueError, match=r"must have shape \(8, 8n\)"):
        model.caption([torch.zeros(8, 0)])
    with pytest.raises(ValueError, match=r"values in \[0, 16\]"):
        model.caption([torch.full((8, 8), 20.0)])
    with pytest.raises(ValueError, match=r"values in \[0, 16\]"):
        model.caption([torch.full((8, 8), float("nan"))])
    with pytest.raises(ValueError, match="at most 8"):
        model.caption([torch.zeros(8, 72)])
    with pytest.raises(TypeError, match="list of images"):
        model.caption(torch.zeros(8, 8))
    with pytest.raises(TypeError, match="numpy array or tensor"):
        model.caption(["seven"])


def test_cli_writes_the_figure_and_the_page(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from attnkit.cli import main

    assert main(["caption", "--digits", "7,3,1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == "seven three one"
    figure = matplotlib.image.imread(tmp_path / "caption.png")
    assert figure.shape[0] > 200 and figure[..., :3].std() > 0.05
    page = (tmp_path / "caption.html").read_text(encoding="utf-8")
    assert '"words":["seven","three","one"]' in page and "http" not in page
    np.save(tmp_path / "strip.npy", captioner.strip_of(captioner.split("test")[:2].tolist()).numpy())
    assert main(["caption", "--image", str(tmp_path / "strip.npy"), "--out", str(tmp_path / "b")]) == 0
    assert main(["caption", "--digits", "7,x", "--out", str(tmp_path / "c")]) == 2
    assert main(["caption", "--out", str(tmp_path / "d")]) == 2
    np.save(tmp_path / "bad.npy", np.zeros((8, 5)))
    assert main(["caption", "--image", str(tmp_path / "bad.npy"), "--out", str(tmp_path / "e")]) == 2


# regression: finding F18 of the review of the seams between features
def test_caption_of_a_file_that_is_not_an_image(tmp_path, capsys):
    for name, data in (("fake.png", b"not an image"), ("fake.npy", b"\x93NUMPY garbage")):
        (tmp_path / name).write_bytes(data)
        assert main(["caption", "--image", str(tmp_path / name), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "--image" in err and "Traceback" not in err
