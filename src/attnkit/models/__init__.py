"""Real models built only from attnkit parts."""

from attnkit.models.captioner import DigitCaptioner
from attnkit.models.minilm import MiniLM
from attnkit.models.recall import RecallLM
from attnkit.models.recommender import SASRec
from attnkit.models.speech import SpeechRecognizer
from attnkit.models.translator import DateTranslator

__all__ = ["DateTranslator", "DigitCaptioner", "MiniLM", "RecallLM", "SASRec", "SpeechRecognizer"]
